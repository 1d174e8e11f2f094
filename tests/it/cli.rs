//! The binary's own surface: `--version` and `config example` (its output is a commented config
//! that `config validate` accepts once its secret variables are set).

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_continuum-router");

fn run(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("ROUTER_ADMIN_TOKEN")
        .env_remove("CLIENT_API_KEY");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("run the binary");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn version_names_the_crate_version_and_the_compiled_features() {
    let (ok, out) = run(&["--version"], &[]);
    assert!(ok, "{out}");
    assert_eq!(
        out.trim(),
        format!(
            "continuum-router {} (features: {})",
            env!("CARGO_PKG_VERSION"),
            continuum_router::build_info::FEATURES
        )
    );
}

#[test]
fn config_example_is_a_commented_config_that_validates() {
    let (ok, example) = run(&["config", "example"], &[]);
    assert!(ok, "{example}");
    assert!(
        example
            .lines()
            .filter(|l| l.trim_start().starts_with('#'))
            .count()
            > 10
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("router.yaml");
    std::fs::write(&path, &example).expect("write");
    let path = path.to_str().expect("UTF-8 path");
    let (ok, report) = run(
        &["config", "validate", "--config", path],
        &[
            ("ROUTER_ADMIN_TOKEN", "a-long-enough-admin-token-0123456789"),
            ("CLIENT_API_KEY", "client-key"),
        ],
    );
    assert!(ok, "{report}");
    // Without its secrets the starter names the missing variable instead of starting.
    let (ok, report) = run(&["config", "validate", "--config", path], &[]);
    assert!(!ok);
    assert!(report.contains("ROUTER_ADMIN_TOKEN"), "{report}");
}
