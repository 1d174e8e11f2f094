//! A test that installs process-global state (the global tracing subscriber, the OpenTelemetry
//! tracer provider) runs in a child process of the test binary: every integration test lives in
//! one binary, and libtest runs them as threads of one process, where a second global install
//! fails and a global log capture would also capture its neighbours.

use std::process::Command;

/// Set in the child to the one test it runs.
const CHILD: &str = "CONTINUUM_IT_OWN_PROCESS";

/// Call first in such a test as `if !own_process(module_path!(), "fn_name") { return; }`.
/// True in the child process that runs the test (the caller goes on with its body). In the
/// test binary's own process it runs the binary again with only this test selected, asserts
/// that the test ran there and passed, and returns false (the caller returns).
pub fn own_process(module: &str, function: &str) -> bool {
    // libtest names a test by its path without the crate: `otlp_export::name`.
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    let test = if module.is_empty() {
        function.to_owned()
    } else {
        format!("{module}::{function}")
    };
    if std::env::var_os(CHILD).is_some_and(|v| v == test.as_str()) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(exe)
        .args([test.as_str(), "--exact", "--test-threads=1"])
        .env(CHILD, &test)
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} in its own process ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    false
}
