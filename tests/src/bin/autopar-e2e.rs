//! The shipped `autopar` entry point, built inside this package so that cargo hands its path to
//! the integration tests (`CARGO_BIN_EXE_autopar-e2e`): the tests run the real binary as a
//! process, exit codes and all.

fn main() -> std::process::ExitCode {
    autopar_cli::main()
}
