//! The server's counters and latency histograms, written in Prometheus'
//! text format by `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use hlo_engine::infer::batcher::BatcherStats;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (k, le) in BUCKETS.iter().enumerate() {
            if seconds <= *le {
                self.counts[k] += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (k, le) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {}", self.counts[k]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Default)]
struct Inner {
    /// (model, status) → requests.
    requests: BTreeMap<(String, u16), u64>,
    /// model → (prompt, completion) tokens.
    tokens: BTreeMap<String, (u64, u64)>,
    ttft: Histogram,
    itl: Histogram,
}

/// What `/metrics` reports besides the batcher's own counters.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// A label value with `\`, `"` and newlines escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn request(&self, model: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((model.to_string(), status))
            .or_default() += 1;
    }

    pub fn tokens(&self, model: &str, prompt: usize, completion: usize) {
        let mut inner = self.lock();
        let t = inner.tokens.entry(model.to_string()).or_default();
        t.0 += prompt as u64;
        t.1 += completion as u64;
    }

    pub(crate) fn time_to_first_token(&self, seconds: f64) {
        self.lock().ttft.observe(seconds);
    }

    pub(crate) fn inter_token_latency(&self, seconds: f64) {
        self.lock().itl.observe(seconds);
    }

    /// Everything in Prometheus' text format (version 0.0.4).
    pub fn render(&self, batcher: &BatcherStats) -> String {
        let inner = self.lock();
        let mut out = String::new();
        inner.write_requests(&mut out);
        inner.write_tokens(&mut out);
        write_batcher_gauges(&mut out, batcher);
        write_adapter_counters(&mut out, batcher);
        write_work_counters(&mut out, batcher);
        inner.ttft.write(
            &mut out,
            "hlo_train_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
        );
        inner.itl.write(
            &mut out,
            "hlo_train_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a request.",
        );
        out
    }
}

impl Inner {
    /// Requests answered, one series per model and HTTP status seen.
    fn write_requests(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP hlo_train_requests_total Requests answered, by model and HTTP status.\n# TYPE hlo_train_requests_total counter"
        );
        for ((model, status), n) in &self.requests {
            let _ = writeln!(
                out,
                "hlo_train_requests_total{{model=\"{}\",status=\"{status}\"}} {n}",
                label(model)
            );
        }
    }

    /// Prompt and completion tokens by model, one counter for each kind.
    fn write_tokens(&self, out: &mut String) {
        for (which, help, pick) in [
            (
                "prompt",
                "Prompt tokens of the requests served.",
                (|t: &(u64, u64)| t.0) as fn(&(u64, u64)) -> u64,
            ),
            ("completion", "Tokens generated.", |t: &(u64, u64)| t.1),
        ] {
            let name = format!("hlo_train_{which}_tokens_total");
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (model, t) in &self.tokens {
                let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", label(model), pick(t));
            }
        }
    }
}

/// The batcher's state right now: what waits, what runs, what still
/// compiles (gauges, since each goes down as well as up).
fn write_batcher_gauges(out: &mut String, batcher: &BatcherStats) {
    let gauges = [
        (
            "hlo_train_queue_depth",
            "Requests waiting for a decode slot.",
            batcher.queued.load(Ordering::Relaxed) as u64,
        ),
        (
            "hlo_train_running_slots",
            "Decode slots generating.",
            batcher.running.load(Ordering::Relaxed) as u64,
        ),
        (
            "hlo_train_step_programs_pending",
            "Programs of steps mixing decode rows and a prompt chunk still being compiled after start (until then such a step runs as two programs).",
            batcher.programs_pending.load(Ordering::Relaxed) as u64,
        ),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
}

/// A counter of the batcher's: its name, its help text and the atomic
/// that counts it.
type Counter<'a> = (&'static str, &'static str, &'a AtomicU64);

/// Each of `counters` as a single unlabelled series.
fn write_counters(out: &mut String, counters: &[Counter]) {
    for (name, help, v) in counters {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
            v.load(Ordering::Relaxed)
        );
    }
}

/// How well the adapter caches serve: the device tables first, then the
/// host cache of parsed adapters that refills them.
fn write_adapter_counters(out: &mut String, batcher: &BatcherStats) {
    let counters = [
        (
            "hlo_train_adapter_cache_hits_total",
            "Requests whose adapter was resident in the device tables.",
            &batcher.adapter_hits,
        ),
        (
            "hlo_train_adapter_cache_misses_total",
            "Requests whose adapter had to be loaded into the device tables.",
            &batcher.adapter_misses,
        ),
        (
            "hlo_train_adapter_loads_total",
            "Adapters written into a device table entry.",
            &batcher.adapter_loads,
        ),
        (
            "hlo_train_adapter_evictions_total",
            "Resident adapters replaced to make room.",
            &batcher.adapter_evictions,
        ),
        (
            "hlo_train_adapter_host_hits_total",
            "Adapter loads served from the host cache of parsed adapters.",
            &batcher.adapter_host_hits,
        ),
        (
            "hlo_train_adapter_host_misses_total",
            "Adapter loads that read the adapter from disk.",
            &batcher.adapter_host_misses,
        ),
    ];
    write_counters(out, &counters);
}

/// The work the batcher did: prefill (and how much of it prefix caching
/// saved), decode steps, and requests dropped when their client left.
fn write_work_counters(out: &mut String, batcher: &BatcherStats) {
    let counters = [
        (
            "hlo_train_prefills_total",
            "Prompts prefilled.",
            &batcher.prefills,
        ),
        (
            "hlo_train_prefill_chunks_total",
            "Prompt chunks prefilled (a prompt longer than a step's chunk takes several).",
            &batcher.prefill_chunks,
        ),
        (
            "hlo_train_prompt_tokens_computed_total",
            "Prompt tokens whose keys and values were computed.",
            &batcher.prompt_tokens_computed,
        ),
        (
            "hlo_train_prompt_tokens_reused_total",
            "Prompt tokens whose keys and values were reused from another request's (prefix caching).",
            &batcher.prompt_tokens_reused,
        ),
        (
            "hlo_train_decode_steps_total",
            "Decode steps run (one token for every running request).",
            &batcher.decode_steps,
        ),
        (
            "hlo_train_cancelled_total",
            "Requests whose client went away before they finished.",
            &batcher.cancelled,
        ),
    ];
    write_counters(out, &counters);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let m = Metrics::default();
        m.time_to_first_token(0.003);
        m.time_to_first_token(0.2);
        m.request("a\"b", 200);
        let text = m.render(&BatcherStats::default());
        assert!(text.contains("hlo_train_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("hlo_train_time_to_first_token_seconds_bucket{le=\"0.25\"} 2"));
        assert!(text.contains("hlo_train_time_to_first_token_seconds_count 2"));
        assert!(text.contains("hlo_train_requests_total{model=\"a\\\"b\",status=\"200\"} 1"));
    }
}
