//! The `autopar` binary.

fn main() -> std::process::ExitCode {
    autopar_cli::main()
}
