//! Timing the compiled train step on synthetic data: warm-up steps, then
//! timed ones, each waited for, so the median is the step's time on the
//! devices.

use std::time::Instant;

use hlo_data::Batch;

use crate::error::{EngineError, Result};
use crate::train::session::{scalar, Session};

/// What a benchmark measured.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchResult {
    /// Each timed step's seconds.
    pub step_times: Vec<f64>,
    /// The median of `step_times`.
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// The last step's loss.
    pub loss: f64,
    /// Peak bytes one device held: the device's own figure where the
    /// plugin reports one, else XLA's compiled plan (arguments + outputs −
    /// aliased + temporaries).
    pub peak_bytes: u64,
}

/// A batch of `rows` × `seq` spread-out token ids, every prediction
/// counted, one sample per row.
pub(crate) fn synthetic_batch(rows: usize, seq: usize, vocab: i64) -> Batch {
    let n = rows * seq;
    Batch {
        ids: (0..n)
            .map(|i| ((i as u64 * 2_654_435_761) % vocab as u64) as i32)
            .collect(),
        loss_mask: vec![1.0; n],
        positions: (0..n).map(|i| (i % seq) as i32).collect(),
        segment_ids: vec![1; n],
        // A precomputed reference's per-row log-probs (read only by such a
        // step).
        ref_logps: vec![-1.0; rows],
        // A GRPO step's advantages and per-token log-probs.
        advantages: (0..rows)
            .map(|r| if r % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        old_logps: vec![-1.0; n],
        ref_token_logps: vec![-1.0; n],
        // A KTO step's labels: desirable and undesirable in turn.
        desirable: (0..rows).map(|r| (r % 2) as f32).collect(),
        // A reward model's pair margins.
        margin: vec![0.5; rows],
        targets: n,
        filled_elsewhere: 0,
    }
}

/// Runs `warmup` untimed then `steps` timed steps of `session` on a
/// synthetic batch; `peak_flops` is the mesh's peak for MFU.
pub fn bench(
    session: &mut Session,
    warmup: i64,
    steps: i64,
    peak_flops: f64,
) -> Result<BenchResult> {
    let c = session.config().clone();
    let batch = synthetic_batch(
        c.rows() as usize,
        c.seq as usize,
        session.model().config.vocab_size,
    );
    let placed = session.place_batch(&batch)?;
    let mut times = Vec::new();
    let mut loss = f64::NAN;
    for i in 0..warmup + steps {
        let t = Instant::now();
        let launched = session.launch(&placed)?;
        launched.finished();
        let dt = t.elapsed().as_secs_f64();
        if i >= warmup {
            times.push(dt);
        }
        loss = scalar(&launched.loss)?;
    }
    if !loss.is_finite() {
        return Err(EngineError::BenchLoss { loss });
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let step_time_s = sorted[sorted.len() / 2];
    let compiled = session
        .compiled_memory_stats()?
        .map_or(0, |m| m.total_device_bytes().max(0) as u64);
    let peak_bytes = session.backend().devices()[0]
        .memory_stats()
        .and_then(|s| s.peak_bytes_in_use)
        .map_or(compiled, |p| p as u64);
    Ok(BenchResult {
        step_time_s,
        tokens_per_s: session.tokens_per_step() as f64 / step_time_s,
        mfu: session.step_flops() / step_time_s / peak_flops,
        loss,
        peak_bytes,
        step_times: times,
    })
}
