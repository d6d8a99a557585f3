//! What one train step sends between devices: a model of its collectives
//! per device and per mesh axis, which axes' groups cross nodes, and a
//! time at the interconnect's documented peak.
//!
//! The mesh is `(dp, fsdp, mp)` over the partition rules of
//! [`hlo_models::decoder::partition_rules`]:
//!
//! - `fsdp` splits the batch and the weights: each weight is all-gathered
//!   before use, once in the forward pass and again in the backward pass,
//!   and the trained parameters' gradients are reduce-scattered back to
//!   their shards.
//! - `mp` splits each projection Megatron-style (q/k/v/gate/up by output,
//!   o/down by input): the hidden state is all-reduced after attention and
//!   after the MLP in the forward pass, twice more in the backward pass,
//!   and twice more again where the backward pass recomputes the layer (a
//!   scan over layers, or `remat_layers`); plus the embedding lookup
//!   (vocabulary split) forward and the LM head's input gradient backward.
//! - `dp` replicates the weights: the trained gradients are all-reduced.
//!
//! Bytes are those of ring collectives: for a group of `n`, an all-gather
//! or reduce-scatter of a tensor of `T` bytes sends (and receives)
//! `(n-1)/n·T` per device, an all-reduce `2(n-1)/n·T`. With gradient
//! accumulation every micro-batch runs the forward and backward passes, so
//! gathers, activations and (the accumulator being laid out as the
//! parameters) gradient reductions happen once per micro-batch.
//!
//! This is the schedule of ZeRO-3/FSDP and Megatron; XLA's SPMD partitioner
//! picks its own per op, so the compiled program can differ. Its CPU
//! compile (after-optimization HLO) of the Llama 3.1 8B recipe (fsdp=8,
//! scanned) gathers each layer weight and LoRA tensor exactly twice, but
//! not the embedding table (rows are looked up per shard): 96.6% of the
//! weight bytes here. With few tokens a step (the 405B recipe's 1,024) it
//! gathers o/down_proj's inputs instead of their weights in the forward
//! pass: 82%. Unrolled without remat it gathers weights once and all-reduces
//! activation gradients in the backward pass instead. Under mp, the LoRA
//! rules split the rank over mp, and XLA also gathers hidden states and
//! all-reduces LoRA outputs: about 2.7× the Megatron bytes for the 405B
//! recipe over mp=8. Small collectives (the loss's per-token reductions,
//! the gradient norm) are left out.

use hlo_ir::{DType, TensorType};
use hlo_models::decoder::{
    base_parameter_types, lora_parameter_types, partition_rules, ModelConfig,
};
use hlo_models::train::TrainConfig;
use hlo_partitioner::{Mesh, Rules};

use crate::analysis::hardware::Interconnect;

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllReduce => "all-reduce",
        })
    }
}

/// One kind of traffic of a step over one mesh axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Transfer {
    pub axis: String,
    /// Devices in each of the axis's groups.
    pub axis_size: i64,
    pub collective: Collective,
    /// What moves (`frozen weights, forward + backward`).
    pub what: String,
    /// Collectives of this kind per step (per tensor, per pass).
    pub count: u64,
    /// Bytes each device sends (and receives) per step.
    pub bytes_per_device: f64,
}

/// Bytes per device of a ring collective over `n` devices: all-gather and
/// reduce-scatter move `(n-1)/n` of the whole tensor (`whole_bytes`), an
/// all-reduce twice that.
pub(crate) fn ring_bytes(collective: Collective, n: i64, whole_bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let share = (n - 1) as f64 / n as f64 * whole_bytes;
    match collective {
        Collective::AllGather | Collective::ReduceScatter => share,
        Collective::AllReduce => 2.0 * share,
    }
}

/// A tensor as the step holds it: its bytes on one device and which of
/// the batch axes split it.
struct Held {
    shard_bytes: f64,
    over_fsdp: bool,
}

fn held(rules: &Rules, name: &str, dims: &[i64], dtype: DType, mesh: &Mesh) -> Held {
    let spec = rules.spec_for(name, dims.len());
    let block: i64 = spec.shard_shape(mesh, dims).iter().product();
    Held {
        shard_bytes: (block as f64) * dtype.size_in_bytes() as f64,
        over_fsdp: spec.0.iter().flatten().any(|a| a == "fsdp"),
    }
}

/// The hidden-state all-reduces over `mp` a layer makes (2 forward, 2
/// backward, and those of what the backward recomputes: the whole layer
/// under a scan or `remat_layers`, the MLP under `remat_mlp`), and how
/// the line says the recomputed ones.
fn recomputed_all_reduces(tc: &TrainConfig) -> (u64, &'static str) {
    match (tc.scan_layers || tc.remat_layers, tc.remat_mlp) {
        (true, _) => (6, ", 2 recomputed"),
        (false, true) => (5, ", 1 recomputed (the MLP's)"),
        (false, false) => (4, ""),
    }
}

/// The collectives of one train step of `config` under `tc` on `mesh`, per
/// device, largest first; axes of size 1 and kinds of traffic that do not
/// occur are left out.
pub fn step_traffic(config: &ModelConfig, tc: &TrainConfig, mesh: &Mesh) -> Vec<Transfer> {
    use Collective::{AllGather, AllReduce, ReduceScatter};
    let step = StepMesh::new(config, tc, mesh);
    let (dp, fsdp, mp, micro) = (step.dp, step.fsdp, step.mp, step.micro);
    let base = base_parameter_types(config, tc.dtype);
    let lora = tc
        .lora
        .as_ref()
        .map(|l| lora_parameter_types(config, l))
        .unwrap_or_default();
    let trained = |name: &str| match &tc.lora {
        None => true,
        Some(l) => l.saves_weight(name),
    };
    let weight_gathers = step.weight_gathers(&base);
    let weights = if tc.lora.is_some() {
        "frozen weights, forward + backward"
    } else {
        "weights, forward + backward"
    };
    let lora_gathers = step.weight_gathers(&lora);
    let trained_list = base.iter().filter(|(n, _)| trained(n)).chain(lora.iter());
    let g = step.gradient_reductions(trained_list);
    let grads = if tc.lora.is_some() {
        "LoRA gradients"
    } else {
        "weight gradients"
    };
    let (hidden, hidden_what) = step.hidden_all_reduces(tc);
    let lora_what = "LoRA A/B, forward + backward";
    let replicated_what = format!("{grads} of replicated tensors");
    [
        transfer("fsdp", fsdp, AllGather, weights.into(), weight_gathers),
        transfer("fsdp", fsdp, AllGather, lora_what.into(), lora_gathers),
        transfer(
            "fsdp",
            fsdp,
            ReduceScatter,
            grads.into(),
            g.scatter.times(micro),
        ),
        transfer(
            "fsdp",
            fsdp,
            AllReduce,
            replicated_what,
            g.replicated.times(micro),
        ),
        transfer("mp", mp, AllReduce, hidden_what, hidden),
        transfer("dp", dp, AllReduce, grads.into(), g.over_dp.times(micro)),
    ]
    .into_iter()
    .filter(|t| t.axis_size > 1 && t.count > 0 && t.bytes_per_device > 0.0)
    .collect()
}

/// A transfer of collectives `c` over `axis` (`n` devices a group):
/// `tally`'s count of them, its bytes per device.
fn transfer(axis: &str, n: i64, c: Collective, what: String, tally: Tally) -> Transfer {
    Transfer {
        axis: axis.into(),
        axis_size: n,
        collective: c,
        what,
        count: tally.count,
        bytes_per_device: tally.bytes,
    }
}

/// Collectives of one kind: their bytes per device and their count.
#[derive(Clone, Copy, Default)]
struct Tally {
    bytes: f64,
    count: u64,
}

impl Tally {
    /// One more collective, of `bytes` per device.
    fn add(&mut self, bytes: f64) {
        self.bytes += bytes;
        self.count += 1;
    }

    /// The collectives of `micro` micro-batches, each making these.
    fn times(self, micro: u64) -> Tally {
        Tally {
            bytes: self.bytes * micro as f64,
            count: self.count * micro,
        }
    }
}

/// The reductions of the trained tensors' gradients, per micro-batch.
#[derive(Default)]
struct GradientReductions {
    /// Reduce-scattered over fsdp: the tensors split over it.
    scatter: Tally,
    /// All-reduced over fsdp: the tensors replicated over it.
    replicated: Tally,
    /// All-reduced over dp: every trained tensor.
    over_dp: Tally,
}

/// One step's model on the mesh: its partition rules, the mesh's axis
/// sizes (1 for an axis it lacks) and the micro-batches a step runs.
struct StepMesh<'a> {
    config: &'a ModelConfig,
    rules: Rules,
    mesh: &'a Mesh,
    dp: i64,
    fsdp: i64,
    mp: i64,
    /// Micro-batches per step: each runs the forward and backward passes.
    micro: u64,
}

impl<'a> StepMesh<'a> {
    fn new(config: &'a ModelConfig, tc: &TrainConfig, mesh: &'a Mesh) -> StepMesh<'a> {
        let size = |a: &str| mesh.axis_size(a).unwrap_or(1);
        StepMesh {
            config,
            rules: partition_rules(config),
            mesh,
            dp: size("dp"),
            fsdp: size("fsdp"),
            mp: size("mp"),
            micro: tc.grad_accum.max(1) as u64,
        }
    }

    /// fsdp: every weight of `list` split over fsdp is gathered in the
    /// forward pass and again in the backward one (the scanned backward
    /// recomputes a layer and takes its gradient from one gather), except
    /// the embedding table: its lookup has no input gradient to take.
    /// Returns the gathers of a step.
    fn weight_gathers(&self, list: &[(String, TensorType)]) -> Tally {
        let fsdp = self.fsdp;
        let (mut bytes, mut count) = (0.0, 0u64);
        for (name, ty) in list {
            let h = held(&self.rules, name, &ty.dims, ty.dtype, self.mesh);
            if !h.over_fsdp {
                continue;
            }
            let embed = name == "model.embed_tokens.weight";
            let passes = if embed && !self.config.tie_word_embeddings {
                1
            } else {
                2
            };
            let whole = h.shard_bytes * fsdp as f64;
            bytes += passes as f64 * ring_bytes(Collective::AllGather, fsdp, whole);
            count += passes;
        }
        Tally { bytes, count }.times(self.micro)
    }

    /// Gradients of what is trained: summed over the batch shards, reduced
    /// to each parameter's own layout (scattered over fsdp where the
    /// parameter is split over it, else all-reduced), then over dp.
    fn gradient_reductions<'t>(
        &self,
        trained: impl Iterator<Item = &'t (String, TensorType)>,
    ) -> GradientReductions {
        let (dp, fsdp) = (self.dp, self.fsdp);
        let mut g = GradientReductions::default();
        for (name, ty) in trained {
            let h = held(&self.rules, name, &ty.dims, ty.dtype, self.mesh);
            if h.over_fsdp {
                let whole = h.shard_bytes * fsdp as f64;
                g.scatter
                    .add(ring_bytes(Collective::ReduceScatter, fsdp, whole));
            } else {
                g.replicated
                    .add(ring_bytes(Collective::AllReduce, fsdp, h.shard_bytes));
            }
            g.over_dp
                .add(ring_bytes(Collective::AllReduce, dp, h.shard_bytes));
        }
        g
    }

    /// mp: the hidden state of one device's rows, all-reduced
    /// ([`recomputed_all_reduces`] a layer, plus the embedding's and the
    /// LM head's). Returns those of a step, and what the line says moves.
    fn hidden_all_reduces(&self, tc: &TrainConfig) -> (Tally, String) {
        let config = self.config;
        let rows = tc.batch as f64 / (self.dp * self.fsdp) as f64;
        let hidden =
            rows * tc.seq as f64 * config.hidden_size as f64 * tc.dtype.size_in_bytes() as f64;
        let (per_layer, recomputed) = recomputed_all_reduces(tc);
        let act_n = (per_layer * config.num_hidden_layers as u64 + 2) * self.micro;
        let act = act_n as f64 * ring_bytes(Collective::AllReduce, self.mp, hidden);
        let act_what = format!(
            "hidden states: per layer 2 forward{}, 2 backward; embedding, LM head",
            recomputed
        );
        let tally = Tally {
            bytes: act,
            count: act_n,
        };
        (tally, act_what)
    }
}

/// Where an axis's groups lie relative to the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Span {
    /// Every group within one node.
    Within,
    /// Every group over several nodes.
    Across,
    /// Some groups over several nodes (the mesh does not align with the
    /// nodes): `crossing` of `groups`.
    Partly { crossing: i64, groups: i64 },
}

impl Span {
    /// Whether any group crosses nodes (so the slow link sets the pace).
    pub fn crosses(self) -> bool {
        self != Span::Within
    }

    /// `within`, `across` or `partly` (for JSON).
    pub fn key(self) -> &'static str {
        match self {
            Span::Within => "within",
            Span::Across => "across",
            Span::Partly { .. } => "partly",
        }
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Span::Within => f.write_str("within"),
            Span::Across => f.write_str("across"),
            Span::Partly { crossing, groups } => write!(f, "across ({crossing} of {groups})"),
        }
    }
}

/// Where the groups of axis `axis` (an index into the mesh's axes) lie
/// when devices are numbered process-major, `devices_per_node` to a node
/// (process `p` holds devices `p·L .. p·L+L-1`), and the mesh is laid over
/// them in row-major order: a group crosses nodes iff its members' nodes
/// differ. `devices_per_node` < 1 counts as 1.
pub(crate) fn axis_span(mesh: &Mesh, axis: usize, devices_per_node: i64) -> Span {
    let axes = mesh.axes();
    let Some(&(_, n)) = axes.get(axis) else {
        return Span::Within;
    };
    let per_node = devices_per_node.max(1);
    // Row-major: neighbours along `axis` are `stride` device numbers apart.
    let stride: i64 = axes[axis + 1..].iter().map(|(_, s)| s).product();
    let (mut groups, mut crossing) = (0i64, 0i64);
    for d in 0..mesh.size() {
        // Each group once, from its member of coordinate 0 on the axis.
        if (d / stride) % n != 0 {
            continue;
        }
        groups += 1;
        let node = d / per_node;
        if (1..n).any(|j| (d + j * stride) / per_node != node) {
            crossing += 1;
        }
    }
    match crossing {
        0 => Span::Within,
        c if c == groups => Span::Across,
        c => Span::Partly {
            crossing: c,
            groups,
        },
    }
}

/// A [`Transfer`] placed on the nodes: its span and, with an interconnect,
/// the link it is paced by and its time.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacedTransfer {
    pub transfer: Transfer,
    pub span: Span,
    /// GB/s of the slowest link the axis uses (None: no figures).
    pub link_gbs: Option<f64>,
    /// Bytes over the link's rate, in milliseconds.
    pub ms: Option<f64>,
}

/// Places `transfers` on a mesh of `nodes` nodes (`mesh.size()` must be a
/// multiple of `nodes`; the caller checks) with `net`'s links.
pub fn place(
    transfers: &[Transfer],
    mesh: &Mesh,
    nodes: i64,
    net: Option<Interconnect>,
) -> Vec<PlacedTransfer> {
    let per_node = mesh.size() / nodes.max(1);
    transfers
        .iter()
        .map(|t| {
            let span = mesh
                .axis_index(&t.axis)
                .map_or(Span::Within, |i| axis_span(mesh, i, per_node));
            let link_gbs = net.map(|n| n.link_gbs(span.crosses()));
            PlacedTransfer {
                transfer: t.clone(),
                span,
                link_gbs,
                ms: link_gbs.map(|g| t.bytes_per_device / (g * 1e9) * 1e3),
            }
        })
        .collect()
}

/// One train step's communication laid on the nodes: where each mesh
/// axis's groups lie, and each kind of traffic with its link and time.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCommunication {
    pub nodes: i64,
    pub devices_per_node: i64,
    /// Each mesh axis: name, size, where its groups lie.
    pub axes: Vec<(String, i64, Span)>,
    /// [`step_traffic`]'s rows, placed.
    pub rows: Vec<PlacedTransfer>,
    /// The links the times are at (None: no figures for the device).
    pub links: Option<Interconnect>,
}

impl StepCommunication {
    /// The step of `config` under `tc` on `mesh` over `nodes` nodes
    /// (`mesh.size()` must be a multiple of `nodes`; the caller checks),
    /// timed at `links` when given.
    pub fn new(
        config: &ModelConfig,
        tc: &TrainConfig,
        mesh: &Mesh,
        nodes: i64,
        links: Option<Interconnect>,
    ) -> StepCommunication {
        let devices_per_node = mesh.size() / nodes.max(1);
        let axes = mesh
            .axes()
            .iter()
            .enumerate()
            .map(|(i, (name, size))| (name.clone(), *size, axis_span(mesh, i, devices_per_node)))
            .collect();
        let rows = place(&step_traffic(config, tc, mesh), mesh, nodes, links);
        StepCommunication {
            nodes,
            devices_per_node,
            axes,
            rows,
            links,
        }
    }

    /// Bytes each device sends per step, every row together.
    pub fn total_bytes(&self) -> f64 {
        self.rows.iter().map(|r| r.transfer.bytes_per_device).sum()
    }

    /// The rows' times added (None without link figures).
    pub fn total_ms(&self) -> Option<f64> {
        self.links?;
        self.rows.iter().map(|r| r.ms).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_models::decoder::LoraConfig;

    /// Two layers of round sizes: hidden 64, MLP 128, 4 heads of 16 (2 kv
    /// heads), vocabulary 256, untied head.
    fn config() -> ModelConfig {
        let mut c = ModelConfig::preset("tiny").unwrap();
        c.vocab_size = 256;
        c
    }

    fn mesh(text: &str) -> Mesh {
        text.parse().unwrap()
    }

    fn find<'a>(t: &'a [Transfer], axis: &str, c: Collective, what: &str) -> &'a Transfer {
        t.iter()
            .find(|x| x.axis == axis && x.collective == c && x.what.starts_with(what))
            .unwrap_or_else(|| panic!("no {axis} {c} {what} in {t:?}"))
    }

    /// Per layer (in, out): q 64→64, k/v 64→32, o 64→64, gate/up 64→128,
    /// down 128→64.
    const LAYER_WEIGHTS: f64 = (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 128 + 128 * 64) as f64;

    #[test]
    fn lora_over_fsdp_gathers_weights_twice_and_scatters_lora_gradients() {
        let c = config();
        let lora = LoraConfig::new(8, 16.0, &["q_proj", "v_proj"], false).unwrap();
        let mut tc = TrainConfig::new(DType::BF16, 8, 16).with_lora(Some(lora));
        tc.scan_layers = true;
        let t = step_traffic(&c, &tc, &mesh("dp=1,fsdp=4,mp=1"));
        // Layers: 2 × 36,864 elements, 2 bytes, gathered twice; embedding
        // (256 × 64) once, LM head twice; each device receives 3/4.
        let whole = 2.0 * (2.0 * 2.0 * LAYER_WEIGHTS + 256.0 * 64.0 * 3.0);
        let w = find(&t, "fsdp", Collective::AllGather, "frozen");
        assert_eq!(w.bytes_per_device, 0.75 * whole);
        assert_eq!(w.count, 2 * 2 * 7 + 3);
        // LoRA (f32): q A 64×8, B 8×64; v A 64×8, B 8×32, per layer.
        let lora_whole = 4.0 * 2.0 * (64.0 * 8.0 + 8.0 * 64.0 + 64.0 * 8.0 + 8.0 * 32.0);
        let l = find(&t, "fsdp", Collective::AllGather, "LoRA");
        assert_eq!(l.bytes_per_device, 0.75 * 2.0 * lora_whole);
        let g = find(&t, "fsdp", Collective::ReduceScatter, "LoRA");
        assert_eq!(g.bytes_per_device, 0.75 * lora_whole);
        assert_eq!(g.count, 8);
        // No other axis moves anything.
        assert_eq!(t.len(), 3, "{t:?}");
    }

    #[test]
    fn mp_all_reduces_hidden_states_and_dp_all_reduces_gradients() {
        let c = config();
        let lora = LoraConfig::new(8, 16.0, &["q_proj"], false).unwrap();
        let tc = TrainConfig::new(DType::F32, 8, 16).with_lora(Some(lora));
        // Unrolled, no remat: 4 per layer + embedding + head = 10.
        let t = step_traffic(&c, &tc, &mesh("dp=2,fsdp=1,mp=2"));
        let a = find(&t, "mp", Collective::AllReduce, "hidden");
        // 4 rows per dp group × 16 tokens × 64 × 4 bytes; 2·(1/2) each.
        assert_eq!(a.count, 10);
        assert_eq!(a.bytes_per_device, 10.0 * (4.0 * 16.0 * 64.0 * 4.0));
        // Scanned: 2 more per layer.
        let mut scanned = tc.clone();
        scanned.scan_layers = true;
        let t2 = step_traffic(&c, &scanned, &mesh("dp=2,fsdp=1,mp=2"));
        assert_eq!(find(&t2, "mp", Collective::AllReduce, "hidden").count, 14);
        // dp: q's LoRA split over mp: A 64×(8/2), B (8/2)×64, f32, per
        // layer; all-reduced over 2: 2·(1/2) of the shard.
        let d = find(&t, "dp", Collective::AllReduce, "LoRA");
        assert_eq!(d.bytes_per_device, 2.0 * 4.0 * (64.0 * 4.0 + 4.0 * 64.0));
        assert_eq!(d.count, 4);
    }

    #[test]
    fn full_finetuning_reduces_every_weight_and_accumulation_repeats_it() {
        let c = config();
        let mut tc = TrainConfig::new(DType::BF16, 8, 16);
        tc.grad_accum = 3;
        let t = step_traffic(&c, &tc, &mesh("dp=1,fsdp=2,mp=1"));
        // Split weights: layers + embedding + head, bf16, scattered 1/2.
        let split = 2.0 * (2.0 * LAYER_WEIGHTS + 2.0 * 256.0 * 64.0);
        let g = find(&t, "fsdp", Collective::ReduceScatter, "weight");
        assert_eq!(g.bytes_per_device, 3.0 * 0.5 * split);
        // Norms (replicated): 2 per layer + the final one, all-reduced.
        let norms = 2.0 * (5.0 * 64.0);
        let n = find(&t, "fsdp", Collective::AllReduce, "weight");
        assert_eq!(n.bytes_per_device, 3.0 * 2.0 * 0.5 * norms);
        assert_eq!(n.count, 3 * 5);
        assert!(t.iter().all(|x| x.what != "LoRA A/B, forward + backward"));
    }

    #[test]
    fn one_device_moves_nothing() {
        let tc = TrainConfig::new(DType::F32, 8, 16);
        assert!(step_traffic(&config(), &tc, &Mesh::single()).is_empty());
    }

    #[test]
    fn axes_cross_nodes_by_their_members_nodes() {
        let span = |m: &str, axis: usize, per_node: i64| axis_span(&mesh(m), axis, per_node);
        // 2 nodes of 4: fsdp's groups are 4 consecutive devices, dp's
        // pairs 4 apart.
        assert_eq!(span("dp=2,fsdp=4,mp=1", 0, 4), Span::Across);
        assert_eq!(span("dp=2,fsdp=4,mp=1", 1, 4), Span::Within);
        assert_eq!(span("dp=2,fsdp=4,mp=1", 2, 4), Span::Within);
        // One node: nothing crosses.
        assert_eq!(span("dp=2,fsdp=4,mp=1", 0, 8), Span::Within);
        // fsdp=16 over 2 nodes of 8 crosses; mp=8 inside them does not.
        assert_eq!(span("dp=1,fsdp=16,mp=1", 1, 8), Span::Across);
        assert_eq!(span("dp=2,fsdp=1,mp=8", 2, 8), Span::Within);
        assert_eq!(span("dp=2,fsdp=1,mp=8", 0, 8), Span::Across);
        // fsdp=4 × mp=4 on nodes of 8: mp within, fsdp's groups (stride
        // 4) span 2 nodes each.
        assert_eq!(span("dp=1,fsdp=4,mp=4", 2, 8), Span::Within);
        assert_eq!(span("dp=1,fsdp=4,mp=4", 1, 8), Span::Across);
        // Nodes of 6 under mp=4: of the groups 0-3, 4-7 and 8-11 only the
        // middle one crosses; fsdp's groups (0, 4, 8 ...) all do.
        assert_eq!(
            span("dp=1,fsdp=3,mp=4", 2, 6),
            Span::Partly {
                crossing: 1,
                groups: 3
            }
        );
        assert_eq!(span("dp=1,fsdp=3,mp=4", 1, 6), Span::Across);
        // A node per device: every axis of size > 1 crosses, size 1 not.
        assert_eq!(span("dp=2,fsdp=2,mp=2", 1, 1), Span::Across);
        assert_eq!(span("dp=1,fsdp=8,mp=1", 0, 1), Span::Within);
    }

    #[test]
    fn placed_times_use_the_slowest_link() {
        let c = config();
        let lora = LoraConfig::new(8, 16.0, &["q_proj"], false).unwrap();
        let tc = TrainConfig::new(DType::BF16, 8, 16).with_lora(Some(lora));
        let m = mesh("dp=2,fsdp=4,mp=1");
        let t = step_traffic(&c, &tc, &m);
        let net = crate::analysis::hardware::Kind::Mi300x
            .device()
            .links()
            .unwrap();
        let placed = place(&t, &m, 2, Some(net));
        for p in &placed {
            let (span, gbs) = if p.transfer.axis == "dp" {
                (Span::Across, 50.0)
            } else {
                (Span::Within, 448.0)
            };
            assert_eq!((p.span, p.link_gbs), (span, Some(gbs)), "{p:?}");
            let ms = p.transfer.bytes_per_device / (gbs * 1e9) * 1e3;
            assert_eq!(p.ms, Some(ms));
        }
        assert!(placed.iter().any(|p| p.transfer.axis == "dp"));
        assert!(place(&t, &m, 1, None)
            .iter()
            .all(|p| p.ms.is_none() && p.span == Span::Within));
    }

    #[test]
    fn a_step_on_two_nodes_adds_its_rows() {
        let c = config();
        let lora = LoraConfig::new(8, 16.0, &["q_proj"], false).unwrap();
        let tc = TrainConfig::new(DType::BF16, 8, 16).with_lora(Some(lora));
        let m = mesh("dp=2,fsdp=4,mp=1");
        let net = crate::analysis::hardware::Kind::H100.device().links();
        let s = StepCommunication::new(&c, &tc, &m, 2, net);
        assert_eq!((s.nodes, s.devices_per_node), (2, 4));
        let spans: Vec<Span> = s.axes.iter().map(|(_, _, span)| *span).collect();
        assert_eq!(spans, [Span::Across, Span::Within, Span::Within]);
        assert_eq!(s.rows, place(&step_traffic(&c, &tc, &m), &m, 2, net));
        let bytes: f64 = s.rows.iter().map(|r| r.transfer.bytes_per_device).sum();
        assert_eq!(s.total_bytes(), bytes);
        let ms: f64 = s.rows.iter().map(|r| r.ms.unwrap()).sum();
        assert_eq!(s.total_ms(), Some(ms));
        // No links, no times; nothing to move, zero.
        assert_eq!(
            StepCommunication::new(&c, &tc, &m, 2, None).total_ms(),
            None
        );
        let one = StepCommunication::new(&c, &tc, &Mesh::single(), 1, net);
        assert_eq!((one.total_bytes(), one.total_ms()), (0.0, Some(0.0)));
    }
}
