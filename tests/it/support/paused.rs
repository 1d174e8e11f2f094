//! Tests on tokio's paused clock: [`settle`] lets every task that is ready run, without moving
//! the clock (a task waiting on a timer or on IO stays waiting), so a test can check what has
//! happened by a virtual instant before advancing past the next deadline.

/// Yields often enough for the ready tasks (and the ones they wake) to run.
pub async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}
