//! Who this process is in a run of several: from flags, else torchrun-style
//! variables, else SLURM's. Parsing only: nothing here opens a socket.
//!
//! ```
//! use hlo_rendezvous::{Launch, LaunchFlags, LaunchSource};
//! // What `srun -N2 --ntasks-per-node=1` gives the second task.
//! let env = [
//!     ("SLURM_JOB_ID", "4242"),
//!     ("SLURM_NTASKS", "2"),
//!     ("SLURM_PROCID", "1"),
//!     ("SLURM_LOCALID", "0"),
//!     ("SLURM_STEP_NODELIST", "gpu[07-08]"),
//! ];
//! let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
//! let launch = Launch::resolve(&LaunchFlags::default(), get).unwrap().unwrap();
//! assert_eq!((launch.process_id, launch.num_processes), (1, 2));
//! assert_eq!(launch.coordinator, "gpu07:61586"); // 61440 + 4242 % 4096
//! assert_eq!(launch.source, LaunchSource::Slurm);
//! ```

use std::fmt;
use std::time::Duration;

use crate::token::{RunToken, RUN_TOKEN_ENV};

/// How long processes wait for one another by default.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(300);

/// The lowest port derived from a SLURM job id: the coordinator listens on
/// `SLURM_PORT_BASE + job_id % 4096`, so concurrent jobs sharing a node
/// rarely collide and every task derives the same port without talking.
pub const SLURM_PORT_BASE: u16 = 61440;

/// What the command line said (each field overrides the environment's).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchFlags {
    /// `--num-processes`: how many processes the run has.
    pub num_processes: Option<u32>,
    /// `--process-id`: this process's index, 0 to `num_processes - 1`.
    pub process_id: Option<u32>,
    /// `--coordinator`: `HOST:PORT` of process 0's key-value service.
    pub coordinator: Option<String>,
    /// `--init-timeout`: how long processes wait for one another.
    pub init_timeout: Option<Duration>,
    /// `--run-token`: the secret every process proves it holds before it
    /// joins (over `HLO_TRAIN_RUN_TOKEN`).
    pub run_token: Option<RunToken>,
}

/// Where the process count came from, for messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    /// `--num-processes`.
    Flags,
    /// `SLURM_NTASKS` (under `srun`).
    Slurm,
    /// `WORLD_SIZE` (torchrun and other launchers that set its variables).
    Torchrun,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::Flags => "--num-processes",
            LaunchSource::Slurm => "SLURM_NTASKS",
            LaunchSource::Torchrun => "WORLD_SIZE",
        })
    }
}

/// This process's place in a run of several.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// How many processes the run has (more than one).
    pub num_processes: u32,
    /// This process's index, 0 to `num_processes - 1`; process 0 serves
    /// the key-value service.
    pub process_id: u32,
    /// Its index among the processes on its node (`SLURM_LOCALID`,
    /// `LOCAL_RANK`).
    pub local_id: Option<u32>,
    /// How many processes share its node (`SLURM_STEP_TASKS_PER_NODE`,
    /// `LOCAL_WORLD_SIZE`).
    pub local_processes: Option<u32>,
    /// `HOST:PORT` of process 0's key-value service.
    pub coordinator: String,
    /// How long processes wait for one another.
    pub init_timeout: Duration,
    /// Where the process count came from.
    pub source: LaunchSource,
    /// The run token every process must prove it holds (`--run-token`,
    /// else `HLO_TRAIN_RUN_TOKEN`); `None`: the rendezvous admits any
    /// process that reaches it.
    pub run_token: Option<RunToken>,
}

/// A launch that cannot be made sense of.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LaunchError {
    /// A launch that lacks a value it needs (the message says which).
    #[error("{0}")]
    Incomplete(String),
    /// A flag or variable whose value does not parse or is out of range.
    #[error("{name}={value:?}: {reason}")]
    BadValue {
        /// The flag or variable, e.g. `SLURM_NTASKS`.
        name: String,
        /// Its value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn parse_u32(name: &str, value: &str) -> Result<u32, LaunchError> {
    value.trim().parse().map_err(|_| LaunchError::BadValue {
        name: name.into(),
        value: value.into(),
        reason: "not a whole number (0 or more)".into(),
    })
}

/// `id` (of variable `name`) within a count of `n` (of variable `count`).
fn check_index(name: &str, id: u32, count: &str, n: u32) -> Result<(), LaunchError> {
    if id < n {
        return Ok(());
    }
    Err(LaunchError::BadValue {
        name: name.into(),
        value: id.to_string(),
        reason: if n == 1 {
            format!("{count}=1 has only process 0")
        } else {
            format!("{count}={n} numbers the processes 0 to {}", n - 1)
        },
    })
}

fn env_u32(env: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<u32>, LaunchError> {
    env(name).map(|v| parse_u32(name, &v)).transpose()
}

/// The first host of a SLURM node list: `gpu[07-08,11],cpu3` → `gpu07`.
pub fn first_slurm_host(nodelist: &str) -> Option<String> {
    let s = nodelist.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0;
    let end = s
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(s.len(), |(i, _)| i);
    let first = &s[..end];
    let host = match first.find('[') {
        None => first.to_string(),
        Some(open) => {
            let close = first[open..].find(']')? + open;
            let range = first[open + 1..close].split(',').next()?;
            let low = range.split('-').next()?;
            format!("{}{low}{}", &first[..open], &first[close + 1..])
        }
    };
    (!host.is_empty()).then_some(host)
}

/// Tasks on node `node` of a SLURM tasks-per-node list: `"8(x2),4"` gives
/// 8 for nodes 0 and 1, 4 for node 2.
pub fn slurm_tasks_on_node(spec: &str, node: u32) -> Option<u32> {
    let mut seen = 0u32;
    for part in spec.split(',') {
        let (tasks, repeat) = match part.split_once("(x") {
            Some((t, r)) => (t, r.trim_end_matches(')').parse::<u32>().ok()?),
            None => (part, 1),
        };
        let tasks = tasks.trim().parse::<u32>().ok()?;
        if node < seen + repeat {
            return Some(tasks);
        }
        seen += repeat;
    }
    None
}

/// `HOST:PORT` with a port that parses.
fn check_coordinator(name: &str, value: &str) -> Result<(), LaunchError> {
    let bad = |reason: &str| LaunchError::BadValue {
        name: name.into(),
        value: value.into(),
        reason: reason.into(),
    };
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    if host.is_empty() {
        return Err(bad("expected HOST:PORT"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad("the port must be 1 to 65535")),
    }
}

/// How many processes the run has: `--num-processes`, else the launcher's
/// count. `None`: a run of one, which needs no rendezvous (and flags
/// naming a process or coordinator without a count are a mistake).
fn resolve_num_processes(
    flags: &LaunchFlags,
    from_env: Option<&Launch>,
) -> Result<Option<u32>, LaunchError> {
    let num_processes = match (flags.num_processes, from_env) {
        (Some(n), _) => n,
        (None, Some(l)) => l.num_processes,
        (None, None) => {
            if flags.process_id.is_some() || flags.coordinator.is_some() {
                return Err(LaunchError::Incomplete(
                    "--process-id and --coordinator need --num-processes (or a SLURM or torchrun launch)".into(),
                ));
            }
            return Ok(None);
        }
    };
    if num_processes == 0 {
        return Err(LaunchError::BadValue {
            name: "--num-processes".into(),
            value: "0".into(),
            reason: "a run has at least one process".into(),
        });
    }
    Ok((num_processes > 1).then_some(num_processes))
}

/// This process's index: `--process-id`, else the launcher's when its
/// count is the run's (`env_fits`). An index out of range is blamed on
/// whichever flag or variable gave it.
fn resolve_process_id(
    flags: &LaunchFlags,
    env_fits: Option<&Launch>,
    num_processes: u32,
) -> Result<u32, LaunchError> {
    let process_id = match (flags.process_id, env_fits) {
        (Some(k), _) => k,
        (None, Some(l)) => l.process_id,
        (None, None) => {
            return Err(LaunchError::Incomplete(format!(
                "--num-processes {num_processes} needs --process-id K (0 to {})",
                num_processes - 1
            )))
        }
    };
    if process_id >= num_processes {
        let name = match (flags.process_id, env_fits) {
            (None, Some(l)) if l.source == LaunchSource::Torchrun => "RANK",
            (None, Some(_)) => "SLURM_PROCID",
            _ => "--process-id",
        };
        return Err(LaunchError::BadValue {
            name: name.into(),
            value: process_id.to_string(),
            reason: format!(
                "a run of {num_processes} processes numbers them 0 to {}",
                num_processes - 1
            ),
        });
    }
    Ok(process_id)
}

/// Process 0's `HOST:PORT`: `--coordinator`, checked since it is typed
/// by hand, else the launcher's when its count is the run's (`env_fits`).
fn resolve_coordinator(
    flags: &LaunchFlags,
    env_fits: Option<&Launch>,
    num_processes: u32,
) -> Result<String, LaunchError> {
    match (&flags.coordinator, env_fits) {
        (Some(c), _) => {
            check_coordinator("--coordinator", c)?;
            Ok(c.clone())
        }
        (None, Some(l)) => Ok(l.coordinator.clone()),
        (None, None) => Err(LaunchError::Incomplete(format!(
            "--num-processes {num_processes} needs --coordinator HOST:PORT (process 0's address, the same for every process)"
        ))),
    }
}

/// The run token: `--run-token`, else `HLO_TRAIN_RUN_TOKEN`, whatever the
/// launcher, since no launcher passes one.
fn resolve_run_token(
    flags: &LaunchFlags,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<RunToken>, LaunchError> {
    match &flags.run_token {
        Some(t) => Ok(Some(t.clone())),
        None => env(RUN_TOKEN_ENV)
            .map(|text| {
                // The message must not show the token: it is empty here.
                RunToken::new(text).map_err(|e| LaunchError::BadValue {
                    name: RUN_TOKEN_ENV.into(),
                    value: String::new(),
                    reason: format!("{e}; unset it, or set it to the run's secret"),
                })
            })
            .transpose(),
    }
}

impl Launch {
    /// This process's launch: each flag, else the torchrun-style
    /// variables (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT`), else SLURM's (`SLURM_NTASKS`,
    /// `SLURM_PROCID`, `SLURM_LOCALID`, the first host of
    /// `SLURM_STEP_NODELIST` on port 61440 + `SLURM_JOB_ID` mod 4096).
    /// `None`: one process (`--num-processes 1` says so over any
    /// environment).
    pub fn resolve(
        flags: &LaunchFlags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Launch>, LaunchError> {
        let from_env = Self::from_launcher(&env)?;
        let Some(num_processes) = resolve_num_processes(flags, from_env.as_ref())? else {
            return Ok(None);
        };
        let source = match (flags.num_processes, &from_env) {
            (Some(_), _) | (None, None) => LaunchSource::Flags,
            (None, Some(l)) => l.source,
        };
        // A process count from the flags keeps the environment's other
        // fields only if it agrees with the environment's count.
        let env_fits = from_env
            .as_ref()
            .filter(|l| l.num_processes == num_processes);
        let process_id = resolve_process_id(flags, env_fits, num_processes)?;
        let coordinator = resolve_coordinator(flags, env_fits, num_processes)?;
        let run_token = resolve_run_token(flags, &env)?;
        Ok(Some(Launch {
            num_processes,
            process_id,
            local_id: env_fits.and_then(|l| l.local_id),
            local_processes: env_fits.and_then(|l| l.local_processes),
            coordinator,
            init_timeout: flags.init_timeout.unwrap_or(DEFAULT_INIT_TIMEOUT),
            source,
            run_token,
        }))
    }

    /// The launch a launcher's variables describe: torchrun's when
    /// `WORLD_SIZE` is set, else SLURM's when the job has a task count;
    /// `None` when neither launcher's variables are there.
    fn from_launcher(env: &impl Fn(&str) -> Option<String>) -> Result<Option<Launch>, LaunchError> {
        if env("WORLD_SIZE").is_some() {
            Ok(Some(Self::torchrun(env)?))
        } else if env("SLURM_JOB_ID").is_some()
            && (env("SLURM_NTASKS").is_some() || env("SLURM_NPROCS").is_some())
        {
            Ok(Some(Self::slurm(env)?))
        } else {
            Ok(None)
        }
    }

    fn torchrun(env: &impl Fn(&str) -> Option<String>) -> Result<Launch, LaunchError> {
        let need = |name: &str| {
            env(name).ok_or_else(|| {
                LaunchError::Incomplete(format!("WORLD_SIZE is set but {name} is not"))
            })
        };
        let num_processes = parse_u32("WORLD_SIZE", &need("WORLD_SIZE")?)?;
        // A launcher that says no processes is wrong, not a run of one.
        if num_processes == 0 {
            return Err(LaunchError::BadValue {
                name: "WORLD_SIZE".into(),
                value: "0".into(),
                reason: "a run has at least one process".into(),
            });
        }
        if num_processes == 1 {
            // A rank that a world of one cannot have is a launcher's mistake.
            if let Some(rank) = env_u32(env, "RANK")? {
                check_index("RANK", rank, "WORLD_SIZE", 1)?;
            }
            return Ok(Self::alone(LaunchSource::Torchrun));
        }
        let process_id = parse_u32("RANK", &need("RANK")?)?;
        check_index("RANK", process_id, "WORLD_SIZE", num_processes)?;
        let local_id = env_u32(env, "LOCAL_RANK")?;
        let local_processes = env_u32(env, "LOCAL_WORLD_SIZE")?;
        if local_processes == Some(0) {
            return Err(LaunchError::BadValue {
                name: "LOCAL_WORLD_SIZE".into(),
                value: "0".into(),
                reason: "a node has at least one process".into(),
            });
        }
        if let (Some(local), Some(n)) = (local_id, local_processes) {
            check_index("LOCAL_RANK", local, "LOCAL_WORLD_SIZE", n)?;
        }
        let addr = need("MASTER_ADDR")?;
        let port_text = need("MASTER_PORT")?;
        let mut port: u16 = port_text
            .trim()
            .parse()
            .map_err(|_| LaunchError::BadValue {
                name: "MASTER_PORT".into(),
                value: port_text.clone(),
                reason: "the port must be 1 to 65535".into(),
            })?;
        // Under torchrun itself the agent's own store already listens on
        // MASTER_PORT; ours takes the next one.
        if env("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") {
            port = port.checked_add(1).ok_or_else(|| LaunchError::BadValue {
                name: "MASTER_PORT".into(),
                value: port_text.clone(),
                reason: "torchrun's store holds it and no port follows it".into(),
            })?;
        }
        let coordinator = format!("{addr}:{port}");
        check_coordinator("MASTER_ADDR:MASTER_PORT", &coordinator)?;
        Ok(Launch {
            num_processes,
            process_id,
            local_id,
            local_processes,
            coordinator,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            source: LaunchSource::Torchrun,
            run_token: None,
        })
    }

    fn slurm(env: &impl Fn(&str) -> Option<String>) -> Result<Launch, LaunchError> {
        let num_processes = match env_u32(env, "SLURM_NTASKS")? {
            Some(n) => n,
            None => env_u32(env, "SLURM_NPROCS")?.unwrap_or(1),
        };
        if num_processes <= 1 {
            return Ok(Self::alone(LaunchSource::Slurm));
        }
        let process_id = env_u32(env, "SLURM_PROCID")?.ok_or_else(|| {
            LaunchError::Incomplete(
                "SLURM_NTASKS is set but SLURM_PROCID is not (run under srun)".into(),
            )
        })?;
        check_index("SLURM_PROCID", process_id, "SLURM_NTASKS", num_processes)?;
        let job = env("SLURM_JOB_ID").unwrap_or_default();
        let job_id = parse_u32("SLURM_JOB_ID", job.split('_').next().unwrap_or(&job))?;
        let nodelist = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .iter()
        .find_map(|name| env(name).map(|v| (*name, v)))
        .ok_or_else(|| {
            LaunchError::Incomplete(
                "SLURM_NTASKS is set but no SLURM_STEP_NODELIST names the nodes".into(),
            )
        })?;
        let host = first_slurm_host(&nodelist.1).ok_or_else(|| LaunchError::BadValue {
            name: nodelist.0.into(),
            value: nodelist.1.clone(),
            reason: "no host in the node list".into(),
        })?;
        let port = SLURM_PORT_BASE + (job_id % 4096) as u16;
        let node = env_u32(env, "SLURM_NODEID")?.unwrap_or(0);
        let local_processes = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
            .iter()
            .find_map(|name| env(name))
            .and_then(|spec| slurm_tasks_on_node(&spec, node));
        Ok(Launch {
            num_processes,
            process_id,
            local_id: env_u32(env, "SLURM_LOCALID")?,
            local_processes,
            coordinator: format!("{host}:{port}"),
            init_timeout: DEFAULT_INIT_TIMEOUT,
            source: LaunchSource::Slurm,
            run_token: None,
        })
    }

    /// A launcher's run of one process (which `resolve` turns into None).
    fn alone(source: LaunchSource) -> Launch {
        Launch {
            num_processes: 1,
            process_id: 0,
            local_id: None,
            local_processes: None,
            coordinator: String::new(),
            init_timeout: DEFAULT_INIT_TIMEOUT,
            source,
            run_token: None,
        }
    }

    /// The one GPU this process drives when several processes share its
    /// node (one process per GPU): its local index. None: it drives all
    /// of the node's GPUs.
    pub fn visible_device(&self) -> Option<u32> {
        match (self.local_id, self.local_processes) {
            (Some(local), Some(n)) if n > 1 => Some(local),
            _ => None,
        }
    }

    /// "process 1 of 4 (SLURM_NTASKS), coordinator gpu07:61546".
    pub fn describe(&self) -> String {
        format!(
            "process {} of {} ({}), coordinator {}",
            self.process_id, self.num_processes, self.source, self.coordinator
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn slurm_node_lists_give_their_first_host() {
        assert_eq!(
            first_slurm_host("gpu[07-08,11],cpu3").as_deref(),
            Some("gpu07")
        );
        assert_eq!(first_slurm_host("node001").as_deref(), Some("node001"));
        assert_eq!(first_slurm_host("a1,b[2-3]").as_deref(), Some("a1"));
        assert_eq!(
            first_slurm_host("rack[3]-n[1-2]").as_deref(),
            Some("rack3-n[1-2]")
        );
        assert_eq!(first_slurm_host(""), None);
        assert_eq!(slurm_tasks_on_node("8(x2),4", 0), Some(8));
        assert_eq!(slurm_tasks_on_node("8(x2),4", 1), Some(8));
        assert_eq!(slurm_tasks_on_node("8(x2),4", 2), Some(4));
        assert_eq!(slurm_tasks_on_node("8(x2),4", 3), None);
        assert_eq!(slurm_tasks_on_node("1", 0), Some(1));
    }

    #[test]
    fn a_world_of_no_processes_is_refused() {
        let env = env_of(&[("WORLD_SIZE", "0"), ("RANK", "0")]);
        let err = Launch::resolve(&LaunchFlags::default(), &env)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("WORLD_SIZE") && err.contains("at least one"),
            "{err}"
        );
        let one = env_of(&[("WORLD_SIZE", "1"), ("RANK", "0")]);
        assert_eq!(
            Launch::resolve(&LaunchFlags::default(), &one).unwrap(),
            None
        );
    }

    #[test]
    fn launches_come_from_flags() {
        let none = env_of(&[]);
        assert_eq!(
            Launch::resolve(&LaunchFlags::default(), &none).unwrap(),
            None
        );
        let flags = LaunchFlags {
            num_processes: Some(4),
            process_id: Some(2),
            coordinator: Some("10.0.0.1:1234".into()),
            init_timeout: Some(Duration::from_secs(9)),
            run_token: None,
        };
        let l = Launch::resolve(&flags, &none).unwrap().unwrap();
        assert_eq!(
            (
                l.process_id,
                l.num_processes,
                l.coordinator.as_str(),
                l.init_timeout,
                l.source
            ),
            (
                2,
                4,
                "10.0.0.1:1234",
                Duration::from_secs(9),
                LaunchSource::Flags
            )
        );
    }

    #[test]
    fn launches_come_from_torchrun() {
        let torchrun = env_of(&[
            ("WORLD_SIZE", "16"),
            ("RANK", "9"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "29500"),
        ]);
        let l = Launch::resolve(&LaunchFlags::default(), &torchrun)
            .unwrap()
            .unwrap();
        assert_eq!((l.process_id, l.num_processes), (9, 16));
        assert_eq!(l.coordinator, "node-a:29500");
        assert_eq!(l.visible_device(), Some(1));
        assert_eq!(l.source, LaunchSource::Torchrun);
        // Under torchrun itself its agent's store holds MASTER_PORT.
        let agent = env_of(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]);
        let l = Launch::resolve(&LaunchFlags::default(), &agent)
            .unwrap()
            .unwrap();
        assert_eq!(l.coordinator, "127.0.0.1:29501");
        assert_eq!(l.visible_device(), None);
    }

    /// Task 11 of a 16-task Slurm step over two nodes of 8 tasks each.
    fn slurm_step_of_two_nodes() -> impl Fn(&str) -> Option<String> {
        env_of(&[
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_PROCID", "11"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "8(x2)"),
            ("SLURM_STEP_NODELIST", "mi300x-[003-004]"),
        ])
    }

    #[test]
    fn launches_come_from_slurm() {
        let slurm = slurm_step_of_two_nodes();
        let l = Launch::resolve(&LaunchFlags::default(), &slurm)
            .unwrap()
            .unwrap();
        assert_eq!((l.process_id, l.num_processes), (11, 16));
        assert_eq!(
            l.coordinator,
            format!("mi300x-003:{}", 61440 + 123456 % 4096)
        );
        assert_eq!(l.visible_device(), Some(3));
        // A one-task allocation is one process.
        let one = env_of(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_PROCID", "0"),
        ]);
        assert_eq!(
            Launch::resolve(&LaunchFlags::default(), &one).unwrap(),
            None
        );
    }

    #[test]
    fn flags_win_over_slurm_field_by_field() {
        let slurm = slurm_step_of_two_nodes();
        let l = Launch::resolve(
            &LaunchFlags {
                coordinator: Some("127.0.0.1:7000".into()),
                ..Default::default()
            },
            &slurm,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.process_id, l.coordinator.as_str()),
            (11, "127.0.0.1:7000")
        );
        // --num-processes 1 runs alone.
        let alone = LaunchFlags {
            num_processes: Some(1),
            ..Default::default()
        };
        assert_eq!(Launch::resolve(&alone, &slurm).unwrap(), None);
    }

    #[test]
    fn incomplete_or_bad_launches_are_one_line_each() {
        let none = env_of(&[]);
        let cases: Vec<(LaunchFlags, &str)> = vec![
            (
                LaunchFlags {
                    num_processes: Some(2),
                    ..Default::default()
                },
                "--num-processes 2 needs --process-id K (0 to 1)",
            ),
            (
                LaunchFlags {
                    num_processes: Some(2),
                    process_id: Some(1),
                    ..Default::default()
                },
                "--num-processes 2 needs --coordinator HOST:PORT",
            ),
            (
                LaunchFlags {
                    process_id: Some(1),
                    ..Default::default()
                },
                "--process-id and --coordinator need --num-processes",
            ),
            (
                LaunchFlags {
                    num_processes: Some(2),
                    process_id: Some(2),
                    coordinator: Some("h:1".into()),
                    ..Default::default()
                },
                "numbers them 0 to 1",
            ),
            (
                LaunchFlags {
                    num_processes: Some(2),
                    process_id: Some(0),
                    coordinator: Some("nohost".into()),
                    ..Default::default()
                },
                "expected HOST:PORT",
            ),
            (
                LaunchFlags {
                    num_processes: Some(2),
                    process_id: Some(0),
                    coordinator: Some("h:99999".into()),
                    ..Default::default()
                },
                "the port must be 1 to 65535",
            ),
        ];
        for (flags, want) in cases {
            let e = Launch::resolve(&flags, &none).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
            assert!(!e.contains('\n'));
        }
        let e = Launch::resolve(
            &LaunchFlags::default(),
            env_of(&[("WORLD_SIZE", "2"), ("RANK", "0")]),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "WORLD_SIZE is set but MASTER_ADDR is not");
        let e = Launch::resolve(
            &LaunchFlags::default(),
            env_of(&[("SLURM_JOB_ID", "1"), ("SLURM_NTASKS", "two")]),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "SLURM_NTASKS=\"two\": not a whole number (0 or more)"
        );
    }

    #[test]
    fn ranks_outside_the_world_are_one_line_each() {
        let torchrun = |rank: &str, world: &str| {
            env_of(&[
                ("WORLD_SIZE", world),
                ("RANK", rank),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
            ])
        };
        let cases = [
            (
                torchrun("5", "2"),
                "RANK=\"5\": WORLD_SIZE=2 numbers the processes 0 to 1",
            ),
            (
                torchrun("2", "2"),
                "RANK=\"2\": WORLD_SIZE=2 numbers the processes 0 to 1",
            ),
            (
                torchrun("-1", "2"),
                "RANK=\"-1\": not a whole number (0 or more)",
            ),
            (
                torchrun("one", "2"),
                "RANK=\"one\": not a whole number (0 or more)",
            ),
            (
                torchrun("0", "-2"),
                "WORLD_SIZE=\"-2\": not a whole number (0 or more)",
            ),
            (
                torchrun("3", "1"),
                "RANK=\"3\": WORLD_SIZE=1 has only process 0",
            ),
            (
                env_of(&[
                    ("WORLD_SIZE", "4"),
                    ("RANK", "1"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ]),
                "LOCAL_RANK=\"2\": LOCAL_WORLD_SIZE=2 numbers the processes 0 to 1",
            ),
            (
                env_of(&[
                    ("SLURM_JOB_ID", "9"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_PROCID", "7"),
                    ("SLURM_STEP_NODELIST", "n1"),
                ]),
                "SLURM_PROCID=\"7\": SLURM_NTASKS=2 numbers the processes 0 to 1",
            ),
        ];
        for (env, want) in cases {
            let e = Launch::resolve(&LaunchFlags::default(), env).unwrap_err();
            assert_eq!(e.to_string(), want);
        }
        // A flag's id out of range names the flag.
        let e = Launch::resolve(
            &LaunchFlags {
                num_processes: Some(3),
                process_id: Some(3),
                coordinator: Some("h:1".into()),
                ..Default::default()
            },
            env_of(&[]),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--process-id=\"3\": a run of 3 processes numbers them 0 to 2"
        );
    }

    #[test]
    fn the_run_token_comes_from_the_flag_then_the_environment() {
        let flags = LaunchFlags {
            num_processes: Some(2),
            process_id: Some(0),
            coordinator: Some("h:1".into()),
            ..Default::default()
        };
        let env = env_of(&[("HLO_TRAIN_RUN_TOKEN", "from-env")]);
        let l = Launch::resolve(&flags, &env).unwrap().unwrap();
        assert_eq!(l.run_token, Some(RunToken::new("from-env").unwrap()));
        let with_flag = LaunchFlags {
            run_token: Some(RunToken::new("from-flag").unwrap()),
            ..flags.clone()
        };
        let l = Launch::resolve(&with_flag, &env).unwrap().unwrap();
        assert_eq!(l.run_token, Some(RunToken::new("from-flag").unwrap()));
        // Never shown, not even by Debug.
        assert!(!format!("{l:?}").contains("from-flag"), "{l:?}");
        assert_eq!(
            Launch::resolve(&flags, env_of(&[]))
                .unwrap()
                .unwrap()
                .run_token,
            None
        );
        let e = Launch::resolve(&flags, env_of(&[("HLO_TRAIN_RUN_TOKEN", "")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "HLO_TRAIN_RUN_TOKEN=\"\": a run token must not be empty; unset it, or set it to the run's secret"
        );
    }
}
