//! The StableHLO printer: a [`Function`] as an MLIR module in generic form,
//! with scopes as `loc("...")` and input/output names as `jax.arg_info` /
//! `jax.result_info` attributes. Every SSA name is unique in the module, so
//! nested regions never shadow.

use std::fmt::Write;

use hlo_ir::{mlir_string, Function, Lowering, Node, Region, Spelling, TensorType};
use hlo_partitioner::{FunctionShardings, Mesh, PartitionSpec};

use crate::manual::{manual_layout, needs_region, Asked};
use crate::sharding::{sdy_dims, sdy_mesh, sdy_sharding};
use crate::unexpanded;

/// A symbol name from an arbitrary function name (`jit_` + word characters).
pub(crate) fn symbol(name: &str) -> String {
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("jit_{clean}")
}

fn types_list(types: &[TensorType]) -> String {
    types
        .iter()
        .map(TensorType::mlir)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `%7` or `%7:3`, and the names of the results (`%7#0`, ...).
fn result_names(id: usize, n: usize) -> (String, Vec<String>) {
    if n == 1 {
        (format!("%{id}"), vec![format!("%{id}")])
    } else {
        let names = (0..n).map(|k| format!("%{id}#{k}")).collect();
        (format!("%{id}:{n}"), names)
    }
}

/// ` {a = 1, b = 2}` with the names sorted, as MLIR prints them; empty
/// without attributes.
fn attributes(attrs: &[(String, String)]) -> String {
    if attrs.is_empty() {
        return String::new();
    }
    let mut attrs = attrs.to_vec();
    attrs.sort();
    let a: Vec<String> = attrs.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    format!(" {{{}}}", a.join(", "))
}

/// `(tensor<2xf32>) -> tensor<2xf32>`, results in parentheses when several.
fn function_type(operands: &[TensorType], results: &[TensorType]) -> String {
    let results = if results.len() == 1 {
        results[0].mlir()
    } else {
        format!("({})", types_list(results))
    };
    format!("({}) -> {results}", types_list(operands))
}

/// Prints a module's body; one per module so names stay unique.
struct Printer<'a> {
    out: String,
    next: usize,
    /// Whether the program has a mesh (`sdy.mesh @mesh`), which sharding
    /// constraints refer to; without one they print nothing.
    sharded: bool,
    /// The mesh when it has more than one device: ops XLA cannot partition
    /// then run in manual-sharding regions over it.
    manual_mesh: Option<&'a Mesh>,
}

impl Printer<'_> {
    fn fresh(&mut self) -> usize {
        self.next += 1;
        self.next - 1
    }

    /// Prints the nodes of `f` (whose inputs are already named in `names`),
    /// returning the names of its outputs.
    fn body(&mut self, f: &Function, names: &mut [String], indent: &str) -> Vec<String> {
        for node in &f.nodes {
            let operand_types: Vec<TensorType> =
                node.operands.iter().map(|&o| f.ty(o).clone()).collect();
            let result_types: Vec<TensorType> =
                node.results.iter().map(|&r| f.ty(r).clone()).collect();
            let operands: Vec<String> = node
                .operands
                .iter()
                .map(|o| names[o.index()].clone())
                .collect();
            let values = (&operands[..], &operand_types[..], &result_types[..]);
            let spelling = match node.op.rule().stablehlo(&operand_types, &result_types) {
                Lowering::Op(spelling) => spelling,
                Lowering::ShardingConstraint { op, dims } if self.sharded => op.attr(
                    "sharding",
                    sdy_sharding(&PartitionSpec(dims), result_types[0].rank()),
                ),
                Lowering::Manual {
                    operands: asked_in,
                    results: asked_out,
                    ..
                } if self.manual_mesh.is_some() => {
                    let outs = self.manual(node, values, (&asked_in, &asked_out), indent);
                    for (r, name) in node.results.iter().zip(outs) {
                        names[r.index()] = name;
                    }
                    continue;
                }
                Lowering::Manual { op, .. } => op,
                Lowering::Identity | Lowering::ShardingConstraint { .. } => {
                    // Nothing to print: each result is its operand.
                    for (r, o) in node.results.iter().zip(&operands) {
                        names[r.index()] = o.clone();
                    }
                    continue;
                }
                Lowering::Expanded { by } => unexpanded(node.op.name(), by),
            };
            let outs = self.emit(&spelling, values, &node.scope, indent);
            for (r, name) in node.results.iter().zip(outs) {
                names[r.index()] = name;
            }
        }
        f.outputs
            .iter()
            .map(|b| names[b.value.index()].clone())
            .collect()
    }

    /// Prints one op spelled `spelling` on `(operand names, operand types,
    /// result types)`; returns its results' names.
    fn emit(
        &mut self,
        spelling: &Spelling,
        (operands, operand_types, result_types): (&[String], &[TensorType], &[TensorType]),
        scope: &str,
        indent: &str,
    ) -> Vec<String> {
        let id = self.fresh();
        let (lhs, outs) = result_names(id, result_types.len());
        let mut line = format!(
            "{indent}{lhs} = \"{}\"({})",
            spelling.name,
            operands.join(", ")
        );
        if !spelling.regions.is_empty() {
            let inner = format!("{indent}  ");
            let regions: Vec<String> = spelling
                .regions
                .iter()
                .map(|r| self.region(r, &inner))
                .collect();
            line += &format!(" ({})", regions.join(", "));
        }
        line += &attributes(&spelling.attributes);
        line += &format!(" : {}", function_type(operand_types, result_types));
        if !scope.is_empty() {
            line += &format!(" loc({})", mlir_string(scope));
        }
        self.out += &line;
        self.out.push('\n');
        outs
    }

    /// Prints `node` per device inside an `sdy.manual_computation` over
    /// every mesh axis, its values split as `asked` allows
    /// ([`manual_layout`]); returns its results' names.
    fn manual(
        &mut self,
        node: &Node,
        (operands, operand_types, result_types): (&[String], &[TensorType], &[TensorType]),
        asked: Asked,
        indent: &str,
    ) -> Vec<String> {
        let mesh = self.manual_mesh.expect("called with a mesh");
        let layout = manual_layout(mesh, (operand_types, asked.0), (result_types, asked.1));
        let inner = match node
            .op
            .rule()
            .stablehlo(&layout.local_operands, &layout.local_results)
        {
            Lowering::Manual { op, .. } => op,
            other => panic!("`{}` lowers to {other:?} per device", node.op.name()),
        };
        let id = self.fresh();
        let (lhs, outs) = result_names(id, result_types.len());
        let args: Vec<String> = layout
            .local_operands
            .iter()
            .map(|_| format!("%{}", self.fresh()))
            .collect();
        let params: Vec<String> = args
            .iter()
            .zip(&layout.local_operands)
            .map(|(a, t)| format!("{a}: {}", t.mlir()))
            .collect();
        let _ = writeln!(
            self.out,
            "{indent}{lhs} = \"sdy.manual_computation\"({}) ({{\n{indent}^bb0({}):",
            operands.join(", "),
            params.join(", ")
        );
        let local = (
            &args[..],
            &layout.local_operands[..],
            &layout.local_results[..],
        );
        let results = self.emit(&inner, local, &node.scope, &format!("{indent}  "));
        let per_value = |specs: &[PartitionSpec], types: &[TensorType]| {
            let each: Vec<String> = specs
                .iter()
                .zip(types)
                .map(|(s, t)| format!("<@mesh, {}>", sdy_dims(s, t.rank())))
                .collect();
            format!("#sdy.sharding_per_value<[{}]>", each.join(", "))
        };
        let axes: Vec<String> = mesh
            .axes()
            .iter()
            .map(|(a, _)| format!("\"{a}\""))
            .collect();
        let attrs = vec![
            (
                "in_shardings".to_string(),
                per_value(&layout.operands, operand_types),
            ),
            (
                "manual_axes".to_string(),
                format!("#sdy<manual_axes{{{}}}>", axes.join(", ")),
            ),
            (
                "out_shardings".to_string(),
                per_value(&layout.results, result_types),
            ),
        ];
        let _ = write!(
            self.out,
            "{indent}  \"sdy.return\"({}) : ({}) -> ()\n{indent}}}){} : {}",
            results.join(", "),
            types_list(&layout.local_results),
            attributes(&attrs),
            function_type(operand_types, result_types)
        );
        if !node.scope.is_empty() {
            let _ = write!(self.out, " loc({})", mlir_string(&node.scope));
        }
        self.out.push('\n');
        outs
    }

    /// A region: `{\n ^bb0(args): ... "stablehlo.return"(...) \n}`.
    fn region(&mut self, region: &Region, indent: &str) -> String {
        let saved = std::mem::take(&mut self.out);
        match region {
            Region::Combiner(op, dtype) => {
                let t = TensorType::scalar(*dtype);
                let (a, b, r) = (self.fresh(), self.fresh(), self.fresh());
                let ty = t.mlir();
                let _ = writeln!(self.out, "{{\n{indent}^bb0(%{a}: {ty}, %{b}: {ty}):");
                let _ = writeln!(
                    self.out,
                    "{indent}  %{r} = \"stablehlo.{}\"(%{a}, %{b}) : ({ty}, {ty}) -> {ty}",
                    op.names().0
                );
                let _ = write!(
                    self.out,
                    "{indent}  \"stablehlo.return\"(%{r}) : ({ty}) -> ()\n{indent}}}"
                );
            }
            Region::Cond(f) | Region::Body(f) => {
                let mut names = vec![String::new(); f.values.len()];
                let args: Vec<String> = f
                    .inputs
                    .iter()
                    .map(|b| {
                        let id = self.fresh();
                        names[b.value.index()] = format!("%{id}");
                        format!("%{id}: {}", f.ty(b.value).mlir())
                    })
                    .collect();
                let _ = writeln!(self.out, "{{\n{indent}^bb0({}):", args.join(", "));
                let outs = self.body(f, &mut names, &format!("{indent}  "));
                let _ = write!(
                    self.out,
                    "{indent}  \"stablehlo.return\"({}) : ({}) -> ()\n{indent}}}",
                    outs.join(", "),
                    types_list(&f.output_types())
                );
            }
        }
        std::mem::replace(&mut self.out, saved)
    }
}

/// `f` as a StableHLO module with a public `@main`, ready for PJRT.
///
/// ```
/// use hlo_ir::{trace, DType, TensorType};
/// let t = TensorType::new(DType::F32, [2]);
/// let f = trace("double", &[("x", t)], |i| i["x"] + i["x"]).unwrap();
/// let text = hlo_lowering::to_stablehlo(&f);
/// assert!(text.contains("func.func public @main(%arg0: tensor<2xf32> {jax.arg_info = \"x\"})"));
/// assert!(text.contains("\"stablehlo.add\"(%arg0, %arg0)"));
/// ```
pub fn to_stablehlo(f: &Function) -> String {
    to_stablehlo_with(f, None, &[])
}

/// `f` partitioned over `shardings.mesh`: the mesh as `sdy.mesh`, each
/// argument's and result's layout as `sdy.sharding`, constraints as
/// `sdy.sharding_constraint`; compile with `CompileOptions::spmd(n)`.
pub fn to_stablehlo_sharded(f: &Function, shardings: &FunctionShardings) -> String {
    to_stablehlo_with(f, Some(shardings), &[])
}

/// The general form: optional shardings, and `donated` (input, output)
/// pairs marked `tf.aliasing_output` so the output reuses the input's
/// buffer (the input is consumed by the run).
pub fn to_stablehlo_with(
    f: &Function,
    shardings: Option<&FunctionShardings>,
    donated: &[(usize, usize)],
) -> String {
    // Scans are written as while loops, custom-VJP calls as their forward.
    print(&hlo_ir::expand(f), shardings, donated)
}

fn print(
    f: &Function,
    shardings: Option<&FunctionShardings>,
    donated: &[(usize, usize)],
) -> String {
    let mut p = Printer {
        out: String::new(),
        next: 0,
        sharded: shardings.is_some(),
        manual_mesh: needs_region(shardings.map(|s| &s.mesh)),
    };
    let sdy = |specs: Option<&Vec<PartitionSpec>>, i: usize, ty: &TensorType| match specs {
        Some(specs) => format!(", sdy.sharding = {}", sdy_sharding(&specs[i], ty.rank())),
        None => String::new(),
    };
    let mut names = vec![String::new(); f.values.len()];
    let args: Vec<String> = f
        .inputs
        .iter()
        .enumerate()
        .map(|(i, b)| {
            names[b.value.index()] = format!("%arg{i}");
            let ty = f.ty(b.value);
            let alias = match donated.iter().find(|(k, _)| *k == i) {
                Some((_, out)) => format!(", tf.aliasing_output = {out} : i32"),
                None => String::new(),
            };
            format!(
                "%arg{i}: {} {{jax.arg_info = {}{}{alias}}}",
                ty.mlir(),
                mlir_string(&b.name),
                sdy(shardings.map(|s| &s.inputs), i, ty)
            )
        })
        .collect();
    let results: Vec<String> = f
        .outputs
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let ty = f.ty(b.value);
            format!(
                "{} {{jax.result_info = {}{}}}",
                ty.mlir(),
                mlir_string(&b.name),
                sdy(shardings.map(|s| &s.outputs), i, ty)
            )
        })
        .collect();
    let outs = p.body(f, &mut names, "    ");
    let partitions = shardings.map_or(1, |s| s.mesh.size());
    let mut text = String::new();
    let _ = writeln!(
        text,
        "module @{} attributes {{mhlo.num_partitions = {partitions} : i32, mhlo.num_replicas = 1 : i32}} {{",
        symbol(&f.name)
    );
    if let Some(s) = shardings {
        let _ = writeln!(text, "  {}", sdy_mesh(&s.mesh));
    }
    let _ = writeln!(
        text,
        "  func.func public @main({}) -> ({}) {{",
        args.join(", "),
        results.join(", ")
    );
    text += &p.out;
    if outs.is_empty() {
        text += "    func.return\n";
    } else {
        let _ = writeln!(
            text,
            "    func.return {} : {}",
            outs.join(", "),
            types_list(&f.output_types())
        );
    }
    text += "  }\n}\n";
    text
}
