//! Shell completions and the manual page come from the command line's own definition.

use autopar_tests::TempWorkspace;

#[test]
fn completions_and_the_manual_page_name_every_command() {
    let ws = TempWorkspace::default_copy();
    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let r = ws.run(&["completions", shell]);
        assert_eq!(r.code, 0, "{shell}: {}", r.stderr);
        for command in ["build", "export", "run", "calibrate", "completions"] {
            assert!(r.stdout.contains(command), "{shell} completes `{command}`");
        }
    }
    // Flags of subcommands complete too.
    let bash = ws.run(&["completions", "bash"]).stdout;
    assert!(bash.contains("--megatron-layout") && bash.contains("--logical-meshes"));
    let man = ws.run(&["man"]);
    assert_eq!(man.code, 0, "{}", man.stderr);
    assert!(
        man.stdout.contains(".TH autopar 1"),
        "{}",
        &man.stdout[..200]
    );
    assert!(man.stdout.contains("export"));
    // An unknown shell is a usage error.
    let bad = ws.run(&["completions", "tcsh"]);
    assert_eq!(bad.code, 2);
    assert!(bad.stderr.contains("possible values"), "{}", bad.stderr);
}
