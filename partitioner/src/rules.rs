//! Rules: ordered (regex, spec) pairs matched against tensor names, as
//! EasyLM and friends do it; and their application to a traced function.

use hlo_ir::Function;
use regex::Regex;
use serde_json::Value;

use crate::{Mesh, PartitionSpec, ShardingError};

/// Ordered rules; the first whose regex is found in a tensor's name gives
/// its spec. Scalars and names no rule matches are replicated.
///
/// ```
/// use hlo_partitioner::{PartitionSpec, Rules};
/// let rules = Rules::new(&[(r"lora_a$", PartitionSpec::new(&[&["fsdp"], &["mp"]]))]).unwrap();
/// assert_eq!(rules.spec_for("layers.0.q_proj.lora_a", 2), PartitionSpec::new(&[&["fsdp"], &["mp"]]));
/// assert_eq!(rules.spec_for("norm.weight", 1), PartitionSpec::replicated());
/// ```
#[derive(Clone, Debug)]
pub struct Rules {
    rules: Vec<(Regex, PartitionSpec)>,
}

impl Rules {
    pub fn new(rules: &[(&str, PartitionSpec)]) -> Result<Rules, ShardingError> {
        let compiled = rules
            .iter()
            .enumerate()
            .map(|(i, (pattern, spec))| {
                Regex::new(pattern)
                    .map(|r| (r, spec.clone()))
                    .map_err(|e| ShardingError::BadRule {
                        index: i,
                        reason: format!("`{pattern}`: {e}"),
                    })
            })
            .collect::<Result<_, _>>()?;
        Ok(Rules { rules: compiled })
    }

    /// Rules from JSON: `[["regex", SPEC], ...]`, SPEC a list with one entry
    /// per dimension (`null`, `"axis"` or `["axis", "axis"]`) or a string in
    /// JAX's spelling (`"P('fsdp', 'mp')"`).
    pub fn from_json(text: &str) -> Result<Rules, ShardingError> {
        let bad = |index: usize, reason: String| ShardingError::BadRule { index, reason };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(0, format!("not JSON: {e}")))?;
        let list = v
            .as_array()
            .ok_or_else(|| bad(0, "the rules must be a JSON list".into()))?;
        let mut rules: Vec<(String, PartitionSpec)> = Vec::new();
        for (i, item) in list.iter().enumerate() {
            let pair = item
                .as_array()
                .filter(|a| a.len() == 2)
                .ok_or_else(|| bad(i, "expected [regex, spec]".into()))?;
            let pattern = pair[0]
                .as_str()
                .ok_or_else(|| bad(i, "the regex must be a string".into()))?;
            let spec = match &pair[1] {
                Value::String(s) => PartitionSpec::parse(s).map_err(|e| bad(i, e.to_string()))?,
                Value::Null => PartitionSpec::replicated(),
                Value::Array(dims) => PartitionSpec(
                    dims.iter()
                        .map(|d| match d {
                            Value::Null => Ok(Vec::new()),
                            Value::String(a) => Ok(vec![a.clone()]),
                            Value::Array(axes) => axes
                                .iter()
                                .map(|a| {
                                    a.as_str()
                                        .map(str::to_string)
                                        .ok_or_else(|| bad(i, "axis names are strings".into()))
                                })
                                .collect(),
                            _ => Err(bad(
                                i,
                                format!("`{d}` is not null, an axis or a list of axes"),
                            )),
                        })
                        .collect::<Result<_, _>>()?,
                ),
                other => return Err(bad(i, format!("`{other}` is not a spec"))),
            };
            rules.push((pattern.to_string(), spec));
        }
        let refs: Vec<(&str, PartitionSpec)> =
            rules.iter().map(|(p, s)| (p.as_str(), s.clone())).collect();
        Rules::new(&refs)
    }

    /// The spec for a tensor named `name` of rank `rank`.
    pub fn spec_for(&self, name: &str, rank: usize) -> PartitionSpec {
        if rank == 0 {
            return PartitionSpec::replicated();
        }
        self.rules
            .iter()
            .find(|(r, _)| r.is_match(name))
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    }
}

/// The layout of every input and output of a function over a mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionShardings {
    pub mesh: Mesh,
    pub inputs: Vec<PartitionSpec>,
    pub outputs: Vec<PartitionSpec>,
}

impl FunctionShardings {
    /// Applies `rules` to `f`'s inputs and outputs by name and validates
    /// each result against its tensor's shape.
    pub fn from_rules(f: &Function, mesh: &Mesh, rules: &Rules) -> Result<Self, ShardingError> {
        Self::from_rules_stacked(f, mesh, rules, &|_| false)
    }

    /// Like [`FunctionShardings::from_rules`], where tensors for which
    /// `stacked(name)` holds carry a leading layer axis that the rules do not
    /// mention: it stays unsplit and the rule applies to the rest.
    pub fn from_rules_stacked(
        f: &Function,
        mesh: &Mesh,
        rules: &Rules,
        stacked: &dyn Fn(&str) -> bool,
    ) -> Result<Self, ShardingError> {
        let spec = |name: &str, ty: &hlo_ir::TensorType| -> Result<PartitionSpec, ShardingError> {
            let layered = stacked(name) && ty.rank() > 0;
            let mut s = rules.spec_for(name, ty.rank() - layered as usize);
            if layered {
                s.0.insert(0, Vec::new());
            }
            s.validate(mesh, &ty.dims, name)?;
            Ok(s)
        };
        Ok(FunctionShardings {
            mesh: mesh.clone(),
            inputs: f
                .inputs
                .iter()
                .map(|b| spec(&b.name, f.ty(b.value)))
                .collect::<Result<_, _>>()?,
            outputs: f
                .outputs
                .iter()
                .map(|b| spec(&b.name, f.ty(b.value)))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Every input and output replicated.
    pub fn replicated(f: &Function, mesh: &Mesh) -> Self {
        FunctionShardings {
            mesh: mesh.clone(),
            inputs: vec![PartitionSpec::replicated(); f.inputs.len()],
            outputs: vec![PartitionSpec::replicated(); f.outputs.len()],
        }
    }

    /// A `name  type  spec` table of inputs and outputs (for review and
    /// snapshots).
    pub fn report(&self, f: &Function) -> String {
        let mut out = format!("mesh {}\n", self.mesh);
        for (kind, bindings, specs) in [
            ("in ", &f.inputs, &self.inputs),
            ("out", &f.outputs, &self.outputs),
        ] {
            for (b, s) in bindings.iter().zip(specs) {
                out += &format!(
                    "{kind} {:<48} {:<18} {s}\n",
                    b.name,
                    f.ty(b.value).to_string()
                );
            }
        }
        out
    }
}
