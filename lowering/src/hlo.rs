//! The HLO text printer: a [`Function`] as an `HloModule` with an `ENTRY`
//! computation, scopes as `metadata={op_name="..."}`. For dumps and review;
//! PJRT compiles the StableHLO form. Instruction names are unique in the
//! module (`add.7`); multi-result ops produce a tuple and
//! `get-tuple-element`s, and ops spelled [`hlo_ir::Spelling::tupled`]
//! (`while`, `opt-barrier`) also take their operands as one tuple, as HLO
//! requires.

use std::fmt::Write;

use hlo_ir::{Function, Lowering, Region, Spelling, TensorType};
use hlo_partitioner::{FunctionShardings, Mesh, PartitionSpec};

use crate::manual::{manual_layout, needs_region, Asked};
use crate::sharding::gspmd_sharding;
use crate::stablehlo::symbol;
use crate::unexpanded;

fn tuple_type(types: &[TensorType]) -> String {
    format!(
        "({})",
        types
            .iter()
            .map(TensorType::hlo)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// An HLO string literal (`"layers.0"`).
fn hlo_quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A named instruction operand: `f32[2]{0} %add.3`.
#[derive(Clone)]
struct Operand {
    ty: String,
    name: String,
}

impl Operand {
    fn text(&self) -> String {
        format!("{} %{}", self.ty, self.name)
    }
}

struct Printer<'a> {
    next: usize,
    /// Finished non-entry computations, in definition order.
    computations: Vec<String>,
    /// The mesh sharding constraints refer to, if the program is sharded.
    mesh: Option<&'a Mesh>,
}

impl Printer<'_> {
    fn name(&mut self, base: &str) -> String {
        self.next += 1;
        format!("{base}.{}", self.next)
    }

    /// Emits an instruction and returns its operand handle.
    fn inst(
        &mut self,
        lines: &mut String,
        base: &str,
        ty: String,
        call: String,
        attrs: &[(String, String)],
        scope: &str,
    ) -> Operand {
        let name = self.name(base);
        let mut line = format!("  %{name} = {ty} {call}");
        for (k, v) in attrs {
            line += &format!(", {k}={v}");
        }
        if !scope.is_empty() {
            line += &format!(", metadata={{op_name={}}}", hlo_quote(scope));
        }
        lines.push_str(&line);
        lines.push('\n');
        Operand { ty, name }
    }

    /// A scalar combiner computation; returns its name.
    fn combiner(&mut self, op: hlo_ir::ops::BinaryOp, dtype: hlo_ir::DType) -> String {
        let t = TensorType::scalar(dtype).hlo();
        let name = self.name("region");
        let (a, b, r) = (
            self.name("Arg_0"),
            self.name("Arg_1"),
            self.name(op.names().1),
        );
        let mut c = format!("%{name} ({a}: {t}, {b}: {t}) -> {t} {{\n");
        let _ = writeln!(c, "  %{a} = {t} parameter(0)");
        let _ = writeln!(c, "  %{b} = {t} parameter(1)");
        let _ = writeln!(c, "  ROOT %{r} = {t} {}({t} %{a}, {t} %{b})", op.names().1);
        c += "}\n";
        self.computations.push(c);
        name
    }

    /// A loop condition or body: one tuple parameter unpacked into the
    /// function's inputs; the result is the function's output, or a tuple
    /// of its outputs when `tuple_result`.
    fn loop_computation(&mut self, f: &Function, tuple_result: bool) -> String {
        let name = self.name(&symbol(&f.name));
        let param = self.name("param");
        let pty = tuple_type(&f.input_types());
        let mut lines = format!("  %{param} = {pty} parameter(0)\n");
        let p = Operand {
            ty: pty.clone(),
            name: param.clone(),
        };
        let mut values: Vec<Option<Operand>> = vec![None; f.values.len()];
        for (i, b) in f.inputs.iter().enumerate() {
            let gte = self.inst(
                &mut lines,
                "get-tuple-element",
                f.ty(b.value).hlo(),
                format!("get-tuple-element({})", p.text()),
                &[("index".into(), i.to_string())],
                "",
            );
            values[b.value.index()] = Some(gte);
        }
        let outs = self.nodes(f, &mut values, &mut lines);
        let root = if tuple_result {
            let args: Vec<String> = outs.iter().map(Operand::text).collect();
            self.inst(
                &mut lines,
                "tuple",
                tuple_type(&f.output_types()),
                format!("tuple({})", args.join(", ")),
                &[],
                "",
            )
        } else {
            outs[0].clone()
        };
        let lines = mark_root(&lines, &root.name);
        let rty = if tuple_result {
            tuple_type(&f.output_types())
        } else {
            f.output_types()[0].hlo()
        };
        self.computations
            .push(format!("%{name} ({param}: {pty}) -> {rty} {{\n{lines}}}\n"));
        name
    }

    /// Emits `f`'s nodes; `values` holds the handles of its inputs.
    fn nodes(
        &mut self,
        f: &Function,
        values: &mut [Option<Operand>],
        lines: &mut String,
    ) -> Vec<Operand> {
        let get = |values: &[Option<Operand>], v: hlo_ir::ValueId| {
            values[v.index()].clone().expect("defined before use")
        };
        for node in &f.nodes {
            let operand_types: Vec<TensorType> =
                node.operands.iter().map(|&o| f.ty(o).clone()).collect();
            let result_types: Vec<TensorType> =
                node.results.iter().map(|&r| f.ty(r).clone()).collect();
            let operands: Vec<Operand> = node.operands.iter().map(|&o| get(values, o)).collect();
            let scope = node.scope.as_str();
            let typed = (&operands[..], &operand_types[..], &result_types[..]);
            let spelling = match (node.op.rule().hlo(&operand_types, &result_types), self.mesh) {
                (Lowering::Op(spelling), _) => spelling,
                (Lowering::ShardingConstraint { op, dims }, Some(mesh)) => {
                    let rank = result_types[0].rank();
                    op.attr("sharding", gspmd_sharding(mesh, &PartitionSpec(dims), rank))
                }
                (
                    Lowering::Manual {
                        op,
                        operands: asked_in,
                        results: asked_out,
                    },
                    mesh,
                ) => match needs_region(mesh) {
                    Some(mesh) => {
                        let asked = (&asked_in[..], &asked_out[..]);
                        let outs = self.manual(lines, node, mesh, typed, asked);
                        for (r, o) in node.results.iter().zip(outs) {
                            values[r.index()] = Some(o);
                        }
                        continue;
                    }
                    None => op,
                },
                (Lowering::Identity | Lowering::ShardingConstraint { .. }, _) => {
                    // Nothing to print: each result is its operand.
                    for (r, o) in node.results.iter().zip(&operands) {
                        values[r.index()] = Some(o.clone());
                    }
                    continue;
                }
                (Lowering::Expanded { by }, _) => unexpanded(node.op.name(), by),
            };
            let outs = self.emit(lines, &spelling, typed, scope);
            for (r, o) in node.results.iter().zip(outs) {
                values[r.index()] = Some(o);
            }
        }
        f.outputs.iter().map(|b| get(values, b.value)).collect()
    }

    /// Emits one instruction spelled `spelling` on `(operands, operand
    /// types, result types)`; returns its results (unpacked from a tuple
    /// when there are several).
    fn emit(
        &mut self,
        lines: &mut String,
        spelling: &Spelling,
        (operands, operand_types, result_types): (&[Operand], &[TensorType], &[TensorType]),
        scope: &str,
    ) -> Vec<Operand> {
        let mut args: Vec<String> = operands.iter().map(Operand::text).collect();
        if spelling.tupled {
            // The operands go in as one tuple.
            let t = self.inst(
                lines,
                "tuple",
                tuple_type(operand_types),
                format!("tuple({})", args.join(", ")),
                &[],
                scope,
            );
            args = vec![t.text()];
        }
        let mut attrs = spelling.attributes.clone();
        for r in &spelling.regions {
            let (name, computation) = match r {
                Region::Combiner(op, dtype) => ("to_apply", self.combiner(*op, *dtype)),
                Region::Cond(f) => ("condition", self.loop_computation(f, false)),
                Region::Body(f) => ("body", self.loop_computation(f, true)),
            };
            attrs.push((name.into(), format!("%{computation}")));
        }
        let call = match &spelling.literal {
            Some(literal) => format!("{}({literal})", spelling.name),
            None => format!("{}({})", spelling.name, args.join(", ")),
        };
        let types: Vec<String> = match &spelling.result_layouts {
            Some(layouts) => result_types
                .iter()
                .zip(layouts)
                .map(|(t, l)| with_layout(t, l))
                .collect(),
            None => result_types.iter().map(TensorType::hlo).collect(),
        };
        if result_types.len() == 1 && !spelling.tupled {
            let o = self.inst(lines, &spelling.name, types[0].clone(), call, &attrs, scope);
            return vec![o];
        }
        // The results come back as one tuple.
        let ty = format!("({})", types.join(", "));
        let t = self.inst(lines, &spelling.name, ty, call, &attrs, scope);
        self.unpack(lines, &t, &types, scope)
    }

    /// Emits `node` per device between GSPMD's manual-sharding markers, as
    /// `shard_map` lowers to GSPMD: each operand constrained to its split
    /// and cut to its per-device block (`SPMDFullToShardShape`), the op
    /// with `sharding={manual}`, each result put back together
    /// (`SPMDShardToFullShape`).
    fn manual(
        &mut self,
        lines: &mut String,
        node: &hlo_ir::Node,
        mesh: &Mesh,
        (operands, operand_types, result_types): (&[Operand], &[TensorType], &[TensorType]),
        asked: Asked,
    ) -> Vec<Operand> {
        let layout = manual_layout(mesh, (operand_types, asked.0), (result_types, asked.1));
        let inner = match node
            .op
            .rule()
            .hlo(&layout.local_operands, &layout.local_results)
        {
            Lowering::Manual { op, .. } => op,
            other => panic!("`{}` lowers to {other:?} per device", node.op.name()),
        };
        let scope = node.scope.as_str();
        let marker = |target: &str, sharding: String| {
            vec![
                ("custom_call_target".to_string(), format!("\"{target}\"")),
                ("sharding".to_string(), sharding),
            ]
        };
        let manual = || "{manual}".to_string();
        let mut locals = Vec::new();
        for ((o, spec), local) in operands
            .iter()
            .zip(&layout.operands)
            .zip(&layout.local_operands)
        {
            let rank = local.rank();
            let split = marker("Sharding", gspmd_sharding(mesh, spec, rank));
            let c = self.inst(lines, "custom-call", o.ty.clone(), call1(o), &split, scope);
            let cut = marker("SPMDFullToShardShape", manual());
            locals.push(self.inst(lines, "custom-call", local.hlo(), call1(&c), &cut, scope));
        }
        let each: Vec<String> = result_types.iter().map(|_| manual()).collect();
        let sharding = if each.len() == 1 {
            manual()
        } else {
            format!("{{{}}}", each.join(", "))
        };
        let inner = inner.attr("sharding", sharding);
        let typed = (
            &locals[..],
            &layout.local_operands[..],
            &layout.local_results[..],
        );
        let outs = self.emit(lines, &inner, typed, scope);
        let mut globals = Vec::new();
        for ((o, spec), ty) in outs.iter().zip(&layout.results).zip(result_types) {
            let keep = marker("Sharding", manual());
            let c = self.inst(lines, "custom-call", o.ty.clone(), call1(o), &keep, scope);
            let whole = marker(
                "SPMDShardToFullShape",
                gspmd_sharding(mesh, spec, ty.rank()),
            );
            globals.push(self.inst(lines, "custom-call", ty.hlo(), call1(&c), &whole, scope));
        }
        globals
    }

    /// The elements of the tuple `tuple` of `types` (as written, layouts
    /// included).
    fn unpack(
        &mut self,
        lines: &mut String,
        tuple: &Operand,
        types: &[String],
        scope: &str,
    ) -> Vec<Operand> {
        types
            .iter()
            .enumerate()
            .map(|(k, t)| {
                self.inst(
                    lines,
                    "get-tuple-element",
                    t.clone(),
                    format!("get-tuple-element({})", tuple.text()),
                    &[("index".into(), k.to_string())],
                    scope,
                )
            })
            .collect()
    }
}

/// `custom-call(f32[2]{0} %x.1)`.
fn call1(o: &Operand) -> String {
    format!("custom-call({})", o.text())
}

/// `bf16[1,4,8,64]{3,1,2,0}`: `ty` with the layout `minor_to_major`.
fn with_layout(ty: &TensorType, minor_to_major: &[i64]) -> String {
    let dims: Vec<String> = ty.dims.iter().map(i64::to_string).collect();
    let layout: Vec<String> = minor_to_major.iter().map(i64::to_string).collect();
    format!(
        "{}[{}]{{{}}}",
        ty.dtype.hlo_name(),
        dims.join(","),
        layout.join(",")
    )
}

/// Puts `ROOT` on the line defining `name`.
fn mark_root(lines: &str, name: &str) -> String {
    let def = format!("  %{name} = ");
    lines
        .lines()
        .map(|l| {
            if l.starts_with(&def) {
                format!("  ROOT {}\n", &l[2..])
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}

/// `f` as HLO text.
///
/// ```
/// use hlo_ir::{trace, DType, TensorType};
/// let t = TensorType::new(DType::F32, [2]);
/// let f = trace("double", &[("x", t)], |i| i["x"] + i["x"]).unwrap();
/// let text = hlo_lowering::to_hlo_text(&f);
/// assert!(text.starts_with("HloModule jit_double"));
/// assert!(text.contains("add(f32[2]{0} %Arg_0.1, f32[2]{0} %Arg_0.1)"));
/// ```
pub fn to_hlo_text(f: &Function) -> String {
    print(&hlo_ir::expand(f), None)
}

/// `f` with GSPMD `sharding={...}` on parameters, the result tuple and
/// sharding constraints.
pub fn to_hlo_text_sharded(f: &Function, shardings: &FunctionShardings) -> String {
    print(&hlo_ir::expand(f), Some(shardings))
}

fn print(f: &Function, shardings: Option<&FunctionShardings>) -> String {
    let mut p = Printer {
        next: 0,
        computations: Vec::new(),
        mesh: shardings.map(|s| &s.mesh),
    };
    let mut lines = String::new();
    let mut values: Vec<Option<Operand>> = vec![None; f.values.len()];
    let mut params = Vec::new();
    for (i, b) in f.inputs.iter().enumerate() {
        let ty = f.ty(b.value).hlo();
        let attrs: Vec<(String, String)> = shardings
            .map(|s| {
                vec![(
                    "sharding".to_string(),
                    gspmd_sharding(&s.mesh, &s.inputs[i], f.ty(b.value).rank()),
                )]
            })
            .unwrap_or_default();
        let o = p.inst(
            &mut lines,
            &format!("Arg_{i}"),
            ty.clone(),
            format!("parameter({i})"),
            &attrs,
            &b.name,
        );
        params.push(format!("{}: {}", o.name, f.ty(b.value).hlo()));
        values[b.value.index()] = Some(o);
    }
    let outs = p.nodes(f, &mut values, &mut lines);
    let out_ty = tuple_type(&f.output_types());
    let args: Vec<String> = outs.iter().map(Operand::text).collect();
    let root_attrs: Vec<(String, String)> = shardings
        .map(|s| {
            let each: Vec<String> = s
                .outputs
                .iter()
                .zip(&f.outputs)
                .map(|(spec, b)| gspmd_sharding(&s.mesh, spec, f.ty(b.value).rank()))
                .collect();
            vec![("sharding".to_string(), format!("{{{}}}", each.join(", ")))]
        })
        .unwrap_or_default();
    let root = p.inst(
        &mut lines,
        "tuple",
        out_ty.clone(),
        format!("tuple({})", args.join(", ")),
        &root_attrs,
        "",
    );
    let lines = mark_root(&lines, &root.name);
    let entry = p.name("main");
    let in_types: Vec<String> = f.input_types().iter().map(TensorType::hlo).collect();
    let mut text = format!(
        "HloModule {}, entry_computation_layout={{({})->{out_ty}}}\n\n",
        symbol(&f.name),
        in_types.join(", ")
    );
    for c in &p.computations {
        text += c;
        text.push('\n');
    }
    let _ = write!(
        text,
        "ENTRY %{entry} ({}) -> {out_ty} {{\n{lines}}}\n",
        params.join(", ")
    );
    text
}
