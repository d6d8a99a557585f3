//! Programs a run starts (a reward command): each in a process group of
//! its own, remembered until it is killed, so that whatever ends the run
//! (its end, an error, a second signal that exits at once) ends them and
//! anything they started too. (A process killed with SIGKILL can do
//! nothing; its groups outlive it.) Not the run's own threads.

use std::process::{Child, Command};
use std::sync::Mutex;

/// The process groups started and not yet killed.
static GROUPS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Starts `command` as the leader of a new process group, remembered
/// until [`kill_group`].
pub(crate) fn spawn_group(command: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let child = command.process_group(0).spawn()?;
    lock().push(child.id());
    Ok(child)
}

/// Kills `child`'s whole process group and reaps the child.
pub fn kill_group(child: &mut Child) {
    let id = child.id();
    signal_group(id);
    lock().retain(|&g| g != id);
    let _ = child.kill();
    let _ = child.wait();
}

/// Kills every group still remembered: the last thing a process that
/// exits at once does.
pub(crate) fn kill_all() {
    for id in lock().drain(..) {
        signal_group(id);
    }
}

fn signal_group(id: u32) {
    if let Ok(pid) = libc::pid_t::try_from(id) {
        // SAFETY: kill has no memory effects; a group that is gone
        // answers ESRCH, which is what we want anyway.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<u32>> {
    // A panic while holding it cannot leave the list half-changed.
    GROUPS.lock().unwrap_or_else(|p| p.into_inner())
}
