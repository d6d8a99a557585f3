//! What a GPU compiler made of a step, read from the HLO text it
//! optimized (`dump-hlo --target T --optimized`): fusions by kind,
//! library calls (cuBLASLt on CUDA, hipBLASLt on ROCm: XLA names both
//! `__cublas$lt$matmul`), collectives with their bytes, the matmuls'
//! output types, and the instructions XLA's rematerialization cloned.
//!
//! Counts are of instructions in the text: a loop's body (a scan over
//! layers) is counted once however many times it runs.

use std::collections::BTreeMap;
use std::fmt::Write;

/// One collective kind's instructions and the bytes their results hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collective {
    pub count: usize,
    pub bytes: u64,
}

/// The optimized program in figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OptimizedSummary {
    /// Fusions by kind: `loop`, `input`, `output`, and custom ones by
    /// their backend kind (`__triton_nested_gemm_fusion`: a matmul
    /// Triton generates; `__triton`: an elementwise or reduction one).
    pub fusions: BTreeMap<String, usize>,
    /// Custom calls by target (`__cublas$lt$matmul`, `__cudnn$fmha...`).
    pub library_calls: BTreeMap<String, usize>,
    /// `all-gather`, `all-reduce`, `reduce-scatter`, `all-to-all`,
    /// `collective-permute` (their `-start` halves counted as them).
    pub collectives: BTreeMap<String, Collective>,
    /// Matmuls (dots, gemm fusions, library matmuls) by the element type
    /// of their result.
    pub matmul_outputs: BTreeMap<String, usize>,
    /// Instructions cloned by XLA's rematerialization (`.remat` names).
    pub rematerialized: usize,
    /// `while` loops (a scan over layers is one).
    pub loops: usize,
}

const COLLECTIVES: [&str; 5] = [
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
];

impl OptimizedSummary {
    /// Reads the HLO text of an optimized module.
    pub fn of(hlo: &str) -> OptimizedSummary {
        // Computations a fusion calls: their instructions are the
        // fusion's, counted through it.
        let fused: std::collections::BTreeSet<&str> = hlo
            .lines()
            .filter(|l| l.contains(" fusion("))
            .filter_map(|l| attribute(l, "calls=%", ','))
            .collect();
        let mut s = OptimizedSummary::default();
        let mut inside_fused = false;
        for line in hlo.lines() {
            if !line.starts_with(' ') {
                // A computation's header: `%name (…) -> … {` or `ENTRY …`.
                let name = line.trim_start_matches('%');
                let name = name.split([' ', '(']).next().unwrap_or("");
                inside_fused = fused.contains(name);
                continue;
            }
            if inside_fused {
                continue;
            }
            if let Some(inst) = Instruction::parse(line) {
                s.add(&inst, line);
            }
        }
        s
    }

    fn add(&mut self, inst: &Instruction, line: &str) {
        if inst.name.contains(".remat") {
            self.rematerialized += 1;
        }
        let op = inst.op.strip_suffix("-start").unwrap_or(inst.op);
        match op {
            "fusion" => {
                let kind = fusion_kind(line);
                if kind.contains("gemm") {
                    *self.matmul_outputs.entry(inst.dtype()).or_default() += 1;
                }
                *self.fusions.entry(kind).or_default() += 1;
            }
            "custom-call" => {
                let target = attribute(line, "custom_call_target=\"", '"').unwrap_or("?");
                if target.contains("matmul") || target.contains("gemm") {
                    *self.matmul_outputs.entry(inst.dtype()).or_default() += 1;
                }
                *self.library_calls.entry(target.to_string()).or_default() += 1;
            }
            "dot" => {
                *self.matmul_outputs.entry(inst.dtype()).or_default() += 1;
            }
            "while" => self.loops += 1,
            _ if COLLECTIVES.contains(&op) => {
                let c = self.collectives.entry(op.to_string()).or_default();
                c.count += 1;
                c.bytes += inst.bytes();
            }
            _ => {}
        }
    }

    /// A few lines for a person: each figure with what it says.
    pub fn text(&self) -> String {
        let list = |m: &BTreeMap<String, usize>| -> String {
            match m.is_empty() {
                true => "none".into(),
                false => m
                    .iter()
                    .map(|(k, n)| format!("{n} {k}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            }
        };
        let mut out = String::new();
        let _ = writeln!(out, "fusions: {}", list(&self.fusions));
        let _ = writeln!(out, "library calls: {}", list(&self.library_calls));
        let collectives = match self.collectives.is_empty() {
            true => "none".into(),
            false => self
                .collectives
                .iter()
                .map(|(k, c)| format!("{} {k} ({})", c.count, megabytes(c.bytes)))
                .collect::<Vec<_>>()
                .join(", "),
        };
        let _ = writeln!(out, "collectives: {collectives}");
        let _ = writeln!(out, "matmul outputs: {}", list(&self.matmul_outputs));
        let _ = writeln!(
            out,
            "recomputed by XLA's rematerialization: {} instructions; loops: {}",
            self.rematerialized, self.loops
        );
        out
    }
}

/// Bytes in decimal megabytes, as `plan` prints sizes: `16.78 MB`.
fn megabytes(bytes: u64) -> String {
    format!("{:.2} MB", bytes as f64 / 1e6)
}

/// One instruction line: `[ROOT] %name = TYPE op(...)`.
struct Instruction<'a> {
    name: &'a str,
    /// The result's type text: `bf16[8,1024]{1,0}` or a tuple `(…)`.
    ty: &'a str,
    op: &'a str,
}

impl<'a> Instruction<'a> {
    fn parse(line: &'a str) -> Option<Instruction<'a>> {
        let t = line.trim_start();
        let t = t.strip_prefix("ROOT ").unwrap_or(t);
        let t = t.strip_prefix('%')?;
        let (name, rest) = t.split_once(" = ")?;
        // The type runs to the space before the op; a tuple type holds
        // spaces, so match its parentheses.
        let (ty, rest) = match rest.strip_prefix('(') {
            Some(_) => {
                let end = matching_paren(rest)?;
                (&rest[..=end], rest[end + 1..].trim_start())
            }
            None => rest.split_once(' ')?,
        };
        let op = &rest[..rest.find('(')?];
        Some(Instruction { name, ty, op })
    }

    /// The element type of the result (of its first element, a tuple's).
    fn dtype(&self) -> String {
        let t = self.ty.trim_start_matches('(');
        t[..t.find('[').unwrap_or(t.len())].to_string()
    }

    /// Bytes of the result; of a tuple (a `-start`'s operands and
    /// result), its largest element.
    fn bytes(&self) -> u64 {
        self.ty
            .trim_matches(|c| c == '(' || c == ')')
            .split("}, ")
            .filter_map(shape_bytes)
            .max()
            .unwrap_or(0)
    }
}

/// The index of the `)` closing the `(` that `s` starts with.
fn matching_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Bytes of one array type `bf16[8,1024]{1,0}`.
fn shape_bytes(ty: &str) -> Option<u64> {
    let ty = ty.trim().trim_start_matches('(');
    let open = ty.find('[')?;
    let close = ty.find(']')?;
    let size: u64 = match &ty[..open] {
        "pred" | "s8" | "u8" | "f8e4m3fn" | "f8e5m2" => 1,
        "bf16" | "f16" | "s16" | "u16" => 2,
        "f32" | "s32" | "u32" => 4,
        "f64" | "s64" | "u64" | "c64" => 8,
        _ => return None,
    };
    let dims = &ty[open + 1..close];
    let elements: u64 = match dims.is_empty() {
        true => 1,
        false => dims
            .split(',')
            .map(|d| d.trim().parse::<u64>().ok())
            .product::<Option<u64>>()?,
    };
    Some(size * elements)
}

/// The text after `key` up to `end`.
fn attribute<'a>(line: &'a str, key: &str, end: char) -> Option<&'a str> {
    let start = line.find(key)? + key.len();
    let len = line[start..].find(end)?;
    Some(&line[start..start + len])
}

/// A fusion's kind: `loop`, `input`, `output`, or a custom fusion's
/// backend kind.
fn fusion_kind(line: &str) -> String {
    let kind = attribute(line, "kind=k", ',').unwrap_or("?");
    if kind == "Custom" {
        // The backend kind is a field of `fusion_backend_config`, after
        // its tiling where XLA chose one.
        let config = line
            .find("\"fusion_backend_config\":")
            .map(|at| &line[at..]);
        if let Some(k) = config.and_then(|c| attribute(c, "\"kind\":\"", '"')) {
            return k.to_string();
        }
    }
    kind.to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-written module: three gemm fusions (one f32 and two bf16
    /// results, one with its tiling before its kind, as XLA prints a
    /// tiled one), a
    /// loop fusion, a cuBLASLt call, an all-gather of 2 × 1024 × 4096
    /// bf16 (16 MiB) as start/done, an all-reduce of 4096 f32, a remat
    /// clone and a while loop.
    const HLO: &str = r#"HloModule m, is_scheduled=true

%fused_computation.1 (param_0.4: bf16[8,1024,128], param_1.4: bf16[8,1024,128]) -> f32[8,1024,1024] {
  %param_0.4 = bf16[8,1024,128]{2,1,0} parameter(0)
  %param_1.4 = bf16[8,1024,128]{2,1,0} parameter(1)
  ROOT %dot.3 = f32[8,1024,1024]{2,1,0} dot(%param_0.4, %param_1.4), lhs_batch_dims={0}
}

ENTRY %main (p: bf16[8,1024,128]) -> f32[4096] {
  %p = bf16[8,1024,128]{2,1,0} parameter(0), metadata={scheduling_name="p"}, backend_config={"operation_queue_id":"0"}
  %gemm_fusion_dot = f32[8,1024,1024]{2,1,0} fusion(%p, %p), kind=kCustom, calls=%fused_computation.1, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %gemm_fusion_dot.1 = bf16[8,1024,128]{2,1,0} fusion(%p, %p), kind=kCustom, calls=%c, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %loop_fusion.remat = bf16[8,1024,128]{2,1,0} fusion(%p), kind=kLoop, calls=%c2, backend_config={"operation_queue_id":"0"}
  %gemm_fusion_dot.2 = bf16[4,8,512,128]{3,2,1,0} fusion(%p, %p), kind=kCustom, calls=%c3, backend_config={"device_type":"DEVICE_TYPE_INVALID","fusion_backend_config":{"block_level_fusion_config":{"num_warps":"2"},"kind":"__triton_nested_gemm_fusion"}}
  %custom-call.1 = (bf16[1024,4096]{1,0}, s8[4194304]{0}) custom-call(%p, %p), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0"}
  %all-gather-start = (bf16[1024,4096]{1,0}, bf16[2,1024,4096]{2,1,0}) all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}, backend_config={"operation_queue_id":"0"}
  %all-gather-done = bf16[2,1024,4096]{2,1,0} all-gather-done(%all-gather-start), backend_config={"operation_queue_id":"0"}
  %all-reduce = f32[4096]{0} all-reduce(%y), replica_groups={{0,1}}, to_apply=%add, backend_config={"operation_queue_id":"0"}
  %while = (s32[], f32[4096]{0}) while(%t), condition=%cond, body=%body, backend_config={"operation_queue_id":"0"}
  ROOT %r = f32[4096]{0} copy(%all-reduce), backend_config={"operation_queue_id":"0"}
}
"#;

    #[test]
    fn counts_what_the_module_holds() {
        let s = OptimizedSummary::of(HLO);
        assert_eq!(s.fusions["__triton_nested_gemm_fusion"], 3);
        assert_eq!(s.fusions["loop"], 1);
        assert_eq!(s.library_calls["__cublas$lt$matmul"], 1);
        let ag = &s.collectives["all-gather"];
        assert_eq!((ag.count, ag.bytes), (1, 2 * 1024 * 4096 * 2));
        let ar = &s.collectives["all-reduce"];
        assert_eq!((ar.count, ar.bytes), (1, 4096 * 4));
        // The gemm fusions and the library matmul; the dot inside the
        // fused computation is the first fusion's, not another matmul.
        assert_eq!(s.matmul_outputs["f32"], 1);
        assert_eq!(s.matmul_outputs["bf16"], 3);
        assert_eq!(s.rematerialized, 1);
        assert_eq!(s.loops, 1);
        let text = s.text();
        assert!(text.contains("1 all-gather (16.78 MB)"), "{text}");
    }
}
