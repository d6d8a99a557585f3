//! The mixture-of-experts MLP as transformers 5 computes it
//! (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`): a router picks
//! each token's top-k experts from the softmax of its logits (in f32), the
//! chosen probabilities are renormalised where the family says so, and
//! the token's output is the weighted sum of its experts' SwiGLU MLPs.
//! gpt-oss (`GptOssMLP`, [`ExpertStyle::GptOss`]) departs in its router
//! (a bias; the softmax of the top-k logits) and its experts (transposed,
//! interleaved, biased, a clamped SwiGLU); the formulations below are the
//! same for both styles.
//!
//! Dropless: every token reaches all of its top-k experts. Two
//! formulations compute the same sum:
//!
//! - [`MoeKind::Blocks`] (the default): the token-expert assignments are
//!   sorted by expert (a counting sort: ranks from a prefix sum, no sort
//!   op), each expert's group padded to a multiple of the block size; each
//!   block gathers its one expert's weights and runs as one batched
//!   matmul. Work is `(tokens·k + experts·(block − 1))` rows instead of
//!   `tokens·experts`; memory holds one copy of an expert's weights per
//!   block.
//! - [`MoeKind::Dense`]: every expert on every token, weighted by the
//!   routing weights (zero off the top-k). Simple and XLA-friendly but
//!   `experts / k` times the work: the reference the blocks are checked
//!   against, and the alternative `bench` measures.

use hlo_ir::ops::{DotGeneral, Scatter};
use hlo_ir::{full, iota, scope, DType, Tensor, TensorType};

use super::config::{ExpertStyle, Routing};
use super::model::{add_lora, batched_matmul, halves, Decoder, Params};

/// How a mixture-of-experts layer runs its experts (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKind {
    /// Sorted by expert in blocks of `block` rows (None: chosen from the
    /// shape, [`block_size`]).
    Blocks { block: Option<i64> },
    /// Every expert on every token.
    Dense,
}

impl Default for MoeKind {
    fn default() -> Self {
        MoeKind::Blocks { block: None }
    }
}

/// The block size for `assignments` token-expert pairs over `experts`:
/// the mean group size rounded up to a multiple of 8 (at least 8), so the
/// padding adds at most about as many rows as there are assignments and
/// the blocks number at most about twice the experts.
pub fn block_size(assignments: i64, experts: i64) -> i64 {
    let mean = (assignments + experts - 1) / experts.max(1);
    (mean.max(1) + 7) / 8 * 8
}

/// The number of blocks that hold every group of `assignments` split
/// over `experts` when each group is padded to a multiple of `block`: the
/// padding adds fewer than `block` rows per expert.
pub fn block_count(assignments: i64, experts: i64, block: i64) -> i64 {
    (assignments + experts * (block - 1)) / block
}

/// One sparse layer's routing, for HF's load-balancing loss: the top-k
/// assignments per expert and the summed router probabilities per expert
/// (both `[experts]`, f32, over the counted tokens).
#[derive(Clone, Copy)]
pub struct RouterStats {
    pub counts: Tensor,
    pub probs: Tensor,
}

/// HF's `load_balancing_loss_func` over the sparse layers' `stats` of
/// `tokens` tokens each: `experts · Σ_e f_e · P_e`, where `f_e` is
/// expert e's share of assignments and `P_e` its mean router probability,
/// both over all the layers' tokens together.
pub fn load_balancing_loss(stats: &[RouterStats], tokens: Tensor, experts: i64) -> Tensor {
    if stats.is_empty() {
        return tokens.scalar_like(0.0);
    }
    let sum =
        |f: fn(&RouterStats) -> Tensor| stats[1..].iter().fold(f(&stats[0]), |acc, s| acc + f(s));
    let rows = tokens * stats.len() as f64;
    let rows_e = |t: Tensor| t / rows.broadcast_in_dim(&[experts], &[]);
    let share = rows_e(sum(|s| s.counts));
    let prob = rows_e(sum(|s| s.probs));
    (share * prob).sum(&[0]) * experts as f64
}

/// `[.., E]` booleans: `idx[..] == e`.
fn one_hot(idx: Tensor, experts: i64) -> Tensor {
    let mut dims = idx.dims();
    let rank = dims.len() as i64;
    dims.push(experts);
    let keep: Vec<i64> = (0..rank).collect();
    iota(TensorType::new(DType::I32, dims.clone()), rank).eq(idx.broadcast_in_dim(&dims, &keep))
}

/// The `k` largest of `probs: [n, E]` per row, largest first (ties to the
/// lower expert, as `torch.topk` on distinct values), as (values `[n, k]`,
/// differentiable; experts `[n, k]` i32). Compared in f32, where taken
/// values are marked by its lowest number.
///
/// A row holding NaN (a token whose hidden state overflowed) matches no
/// maximum; its picks fall to the last expert so that every assignment
/// names a real expert. Out of range, it would be clamped where the
/// blocks gather their destinations and land on another token's row.
fn top_k(probs: Tensor, k: i64) -> (Tensor, Tensor) {
    let (n, e) = (probs.dims()[0], probs.dims()[1]);
    let experts = iota(TensorType::new(DType::I32, [n, e]), 1);
    let mut remaining = probs.stop_gradient().cast(DType::F32);
    let (mut values, mut picked) = (Vec::new(), Vec::new());
    for _ in 0..k {
        let best = remaining.max(&[1]).broadcast_in_dim(&[n, e], &[0]);
        let none = full(TensorType::new(DType::I32, [n, e]), e as f64);
        let last = full(TensorType::new(DType::I32, [n]), (e - 1) as f64);
        let idx = remaining
            .eq(best)
            .where_(experts, none)
            .min(&[1])
            .minimum(last);
        let hit = one_hot(idx, e);
        values.push((hit.cast(probs.dtype()) * probs).sum(&[1]).reshape(&[n, 1]));
        picked.push(idx.reshape(&[n, 1]));
        let taken = remaining.scalar_like(f32::MIN as f64).broadcast_to(&[n, e]);
        remaining = hit.where_(taken, remaining);
    }
    (Tensor::concat(&values, 1), Tensor::concat(&picked, 1))
}

/// DeepSeek-V3's and GLM-4.5's routing ([`Routing::Sigmoid`]) of f32
/// router `logits: [n, E]` with the selection `bias` `[E]`: each token's
/// `k` experts (`[n, k]` i32) and their weights (`[n, k]` f32,
/// differentiable through the scores only).
fn sigmoid_routing(
    logits: Tensor,
    bias: Tensor,
    routing: Routing,
    k: i64,
    norm_topk_prob: bool,
) -> (Tensor, Tensor) {
    let Routing::Sigmoid {
        n_group,
        topk_group,
        routed_scaling_factor,
    } = routing
    else {
        unreachable!("a sigmoid router")
    };
    let (n, e) = (logits.dims()[0], logits.dims()[1]);
    let scores = logits.logistic();
    // The choice is no function of the weights' gradient.
    let mut choice = scores.stop_gradient() + bias.cast(DType::F32).broadcast_in_dim(&[n, e], &[1]);
    if topk_group < n_group {
        // Each group's score: the sum of its two best biased scores.
        let g = e / n_group;
        let (best_two, _) = top_k(choice.reshape(&[n * n_group, g]), 2);
        let group_scores = best_two.sum(&[1]).reshape(&[n, n_group]);
        let (_, groups) = top_k(group_scores, topk_group);
        let kept = one_hot(groups, n_group).cast(DType::I32).sum(&[1]);
        let kept = kept
            .gt(kept.scalar_like(0.0))
            .broadcast_in_dim(&[n, n_group, g], &[0, 1])
            .reshape(&[n, e]);
        let none = choice.scalar_like(f64::NEG_INFINITY).broadcast_to(&[n, e]);
        choice = kept.where_(choice, none);
    }
    let (_, experts) = top_k(choice, k);
    // The chosen experts' unbiased scores.
    let hit = one_hot(experts, e).cast(DType::F32);
    let mut w = (hit * scores.broadcast_in_dim(&[n, k, e], &[0, 2])).sum(&[2]);
    if norm_topk_prob {
        w = w / (w.sum(&[1]) + 1e-20).broadcast_in_dim(&[n, k], &[0]);
    }
    (w * routed_scaling_factor, experts)
}

/// Inclusive prefix sums of `x` along axis 0 (log₂ steps of shift and add).
fn cumsum0(x: Tensor) -> Tensor {
    let dims = x.dims();
    let n = dims[0];
    let zero = x.scalar_like(0.0);
    let mut y = x;
    let mut shift = 1;
    while shift < n {
        let mut upto = dims.clone();
        upto[0] = n - shift;
        let mut low = vec![0; dims.len()];
        low[0] = shift;
        let none = vec![0; dims.len()];
        y = y + y.slice(&none, &upto).pad(zero, &low, &none, &none);
        shift *= 2;
    }
    y
}

/// `x: [g, rows, c]` times each of a batch of matrices `w`, `[g, out, c]`
/// (`nn.Linear` weights) or `[g, c, out]` when `transposed`, plus the
/// batch's `bias` `[g, out]`: `[g, rows, out]` in `x`'s dtype, as HF's
/// `torch.bmm` and bias add compute it (the product asked for in bf16, not
/// as f32: see [`super::model::linear`]).
fn batched_linear(x: Tensor, w: Tensor, transposed: bool, bias: Option<Tensor>) -> Tensor {
    let dtype = x.dtype();
    let y = x.dot_general(
        w.cast(dtype),
        DotGeneral {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contracting: vec![x.rank() as i64 - 1],
            rhs_contracting: vec![if transposed { 1 } else { 2 }],
            precision: None,
            preferred_element_type: None,
        },
    );
    match bias {
        Some(b) => y + b.cast(dtype).broadcast_in_dim(&y.dims(), &[0, 2]),
        None => y,
    }
}

/// One fused expert tensor (and its bias, gpt-oss) and, when LoRA targets
/// it, its factors taken at the same experts (`lora_a` `[g, in, r]`,
/// `lora_b` `[g, r, out]`) and scale.
#[derive(Clone, Copy)]
struct ExpertWeight {
    weight: Tensor,
    /// `weight` is `[g, in, out]` (gpt-oss), not `[g, out, in]`.
    transposed: bool,
    bias: Option<Tensor>,
    lora: Option<(Tensor, Tensor, f64)>,
}

impl ExpertWeight {
    /// The rows of experts `at` (`[g]` i32): `[g, ..]`.
    fn take(self, at: Tensor) -> ExpertWeight {
        ExpertWeight {
            weight: self.weight.take(at, 0),
            transposed: self.transposed,
            bias: self.bias.map(|b| b.take(at, 0)),
            lora: self.lora.map(|(a, b, s)| (a.take(at, 0), b.take(at, 0), s)),
        }
    }

    /// `x: [g, rows, in]` through expert g's matrix, `[g, rows, out]`; the
    /// LoRA branch in the adapter's dtype, as PEFT's factors compute it.
    fn apply(self, x: Tensor) -> Tensor {
        let y = batched_linear(x, self.weight, self.transposed, self.bias);
        match self.lora {
            Some((a, b, scale)) => {
                let delta = batched_matmul(batched_matmul(x.cast(a.dtype()), a), b) * scale;
                add_lora(y, delta)
            }
            None => y,
        }
    }
}

/// The experts' activation of fused `[.., 2·I]` gate-and-up
/// activations: SwiGLU with the gate first; gpt-oss's clamped SwiGLU with
/// the gate and up columns interleaved (see [`ExpertStyle::GptOss`]).
fn activation(style: ExpertStyle, gate_up: Tensor) -> Tensor {
    match style {
        ExpertStyle::SwiGlu => {
            let (gate, up) = halves(gate_up);
            gate * gate.logistic() * up
        }
        ExpertStyle::GptOss {
            swiglu_alpha,
            swiglu_limit,
        } => {
            let mut dims = gate_up.dims();
            let r = dims.len();
            let i = dims[r - 1] / 2;
            dims[r - 1] = i;
            let mut pairs = dims.clone();
            pairs.push(2);
            let pairs = gate_up.reshape(&pairs);
            let column = |c: i64| {
                let mut start = vec![0; r + 1];
                start[r] = c;
                let mut end = pairs.dims();
                end[r] = c + 1;
                pairs.slice(&start, &end).reshape(&dims)
            };
            let limit = gate_up.scalar_like(swiglu_limit).broadcast_to(&dims);
            let gate = column(0).minimum(limit);
            let up = column(1).minimum(limit).maximum(-limit);
            let glu = gate * (gate * swiglu_alpha).logistic();
            (up + 1.0) * glu
        }
    }
}

impl Decoder<'_> {
    /// The router at `prefix` (`model.layers.3.mlp`) on tokens `xf: [n,
    /// hidden]`: each token's expert weights `[n, k]` (in f32 or the
    /// model's dtype, as the family's HF class keeps them), its experts
    /// `[n, k]` (i32, largest first) and the probabilities `[n, E]` (f32)
    /// the load-balancing loss reads.
    pub fn route(&self, p: &Params, prefix: &str, xf: Tensor) -> (Tensor, Tensor, Tensor) {
        let m = self
            .config
            .moe
            .as_ref()
            .expect("a sparse layer has experts");
        let (n, k, dtype) = (xf.dims()[0], m.top_k, xf.dtype());
        let at = format!("{prefix}.{}", m.router());
        if let Routing::Sigmoid { .. } = m.routing {
            let w = p.get(&format!("{at}.weight")).cast(DType::F32);
            let logits = super::model::linear(xf.cast(DType::F32), w, None);
            let bias = p.get(&format!("{at}.e_score_correction_bias"));
            let (w, experts) = sigmoid_routing(logits, bias, m.routing, k, m.norm_topk_prob);
            return (w, experts, logits.logistic());
        }
        let bias = m.biased().then(|| p.get(&format!("{at}.bias")));
        let logits = super::model::linear(xf, p.get(&format!("{at}.weight")), bias);
        let probs = logits.cast(DType::F32).softmax(1);
        if m.transposed() {
            // gpt-oss: the top-k of the logits, softmaxed among themselves.
            let (top, experts) = top_k(logits, k);
            return (top.cast(DType::F32).softmax(1).cast(dtype), experts, probs);
        }
        let (mut w, experts) = top_k(probs, k);
        if m.norm_topk_prob {
            w = w / w.sum(&[1]).broadcast_in_dim(&[n, k], &[0]);
        }
        if !m.f32_routing_weights {
            w = w.cast(dtype);
        }
        (w, experts, probs)
    }

    /// The sparse MLP at `prefix` (`model.layers.3.mlp`) on `x: [.., hidden]`.
    /// Records the layer's [`RouterStats`] for the load-balancing loss.
    pub fn sparse_mlp(&self, p: &Params, prefix: &str, x: Tensor) -> Tensor {
        let c = self.config;
        let m = c.moe.as_ref().expect("a sparse layer has experts");
        let dims = x.dims();
        let dtype = x.dtype();
        let h = c.hidden_size;
        let n: i64 = dims[..dims.len() - 1].iter().product();
        let (e, k) = (m.num_experts, m.top_k);
        let xf = x.reshape(&[n, h]);
        let (weights, experts, probs) = scope(m.router(), || self.route(p, prefix, xf));
        let hits = one_hot(experts, e).cast(DType::F32).sum(&[0, 1]);
        self.router.borrow_mut().push(RouterStats {
            counts: hits,
            probs: probs.sum(&[0]),
        });
        let expert_weight = |name: &str| {
            let at = format!("{prefix}.experts.{name}");
            let lora = self
                .lora
                .filter(|_| p.has(&format!("{at}.lora_a")))
                .map(|l| {
                    // PEFT matches patterns against the parameter's path.
                    let module = super::model::layer_path(&at);
                    (
                        p.get(&format!("{at}.lora_a")),
                        p.get(&format!("{at}.lora_b")),
                        l.scale_of(&module),
                    )
                });
            ExpertWeight {
                weight: p.get(&at),
                transposed: m.transposed(),
                bias: m.biased().then(|| p.get(&format!("{at}_bias"))),
                lora,
            }
        };
        let act = |x: Tensor| activation(m.style, x);
        let (gate_up, down) = (expert_weight("gate_up_proj"), expert_weight("down_proj"));
        // Each (token, slot)'s expert output `[n, k, hidden]`.
        let outputs = scope("experts", || match self.moe {
            MoeKind::Dense => {
                // [E, n, ..]: every expert on every token.
                let all = xf.broadcast_in_dim(&[e, n, h], &[1, 2]);
                let y = down.apply(act(gate_up.apply(all)));
                // The k chosen of each token: [n, k, hidden].
                let y = y.transpose(&[1, 0, 2]);
                batched_matmul(one_hot(experts, e).cast(dtype), y)
            }
            MoeKind::Blocks { block } => {
                let block = block.unwrap_or_else(|| block_size(n * k, e));
                self.expert_blocks(xf, experts, (gate_up, down), act, block)
                    .reshape(&[n, k, h])
            }
        });
        // Each output times its weight, rounded to the model's dtype as HF
        // adds it into the layer's output, then summed over the k.
        let w = weights.broadcast_in_dim(&[n, k, h], &[0, 1]);
        let y = (outputs.cast(w.dtype()) * w).cast(dtype).sum(&[1]);
        y.reshape(&dims)
    }

    /// The experts' outputs `[n·k, hidden]` for the assignments
    /// `experts: [n, k]` of the tokens `x: [n, hidden]`, sorted by expert
    /// in blocks of `block` rows (see the module docs).
    fn expert_blocks(
        &self,
        x: Tensor,
        experts: Tensor,
        (gate_up, down): (ExpertWeight, ExpertWeight),
        act: impl Fn(Tensor) -> Tensor,
        block: i64,
    ) -> Tensor {
        let (n, h) = (x.dims()[0], x.dims()[1]);
        let k = experts.dims()[1];
        let e = gate_up.weight.dims()[0];
        let a = n * k;
        let i32s = |dims: &[i64]| TensorType::new(DType::I32, dims.to_vec());
        let expert = experts.reshape(&[a]);
        let token = iota(i32s(&[n, k]), 0).reshape(&[a]);
        // Each assignment's rank within its expert's group (stable: in
        // token order), and the groups' sizes.
        let hot = one_hot(expert, e).cast(DType::I32);
        let seen = cumsum0(hot);
        let rank = ((seen - hot) * hot).sum(&[1]);
        let counts = hot.sum(&[0]);
        // Groups padded to whole blocks, one after another.
        let padded = (counts + (block - 1) as f64) / block as f64 * block as f64;
        let ends = cumsum0(padded);
        let starts = ends - padded;
        let dest = starts.take(expert, 0) + rank;
        let blocks = block_count(a, e, block);
        let rows = blocks * block;
        // Which token each sorted row holds (n: none, a row of zeros).
        let held = full(i32s(&[rows]), 0.0).scatter_add(
            dest,
            token + 1.0,
            Scatter {
                update_window_dims: vec![],
                inserted_window_dims: vec![0],
                scatter_dims_to_operand_dims: vec![0],
                index_vector_dim: 1,
            },
        );
        let empty = held.eq(held.scalar_like(0.0));
        let source = empty.where_(full(i32s(&[rows]), n as f64), held - 1.0);
        let padded_x = Tensor::concat(&[x, full(TensorType::new(x.dtype(), [1, h]), 0.0)], 0);
        let sorted = padded_x.take(source, 0).reshape(&[blocks, block, h]);
        // Each block's expert: how many groups end at or before its start
        // (blocks past the last group take the last expert, on zeros).
        let block_start = iota(i32s(&[blocks]), 0) * block as f64;
        let ended = ends
            .broadcast_in_dim(&[blocks, e], &[1])
            .le(block_start.broadcast_in_dim(&[blocks, e], &[0]));
        let owner = ended
            .cast(DType::I32)
            .sum(&[1])
            .minimum(full(i32s(&[blocks]), (e - 1) as f64));
        let y = down
            .take(owner)
            .apply(act(gate_up.take(owner).apply(sorted)));
        y.reshape(&[rows, h]).take(dest, 0)
    }
}
