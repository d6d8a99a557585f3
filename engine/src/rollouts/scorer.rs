//! Per-token log-probabilities of rollouts under the policy or a
//! reference adapter, compiled over a session's own arrays.

use std::collections::HashMap;

use hlo_ir::Literal;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{lora_parameter_types, partition_rules};
use hlo_models::roles::Role;
use hlo_models::train::token_logps_step;
use hlo_partitioner::PartitionSpec;
use hlo_runtime::{DeviceArray, HostArray, Program};

use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};
use crate::train::session::Session;

/// A compiled per-token log-probability program over a session's arrays
/// (and, for a reference adapter, arrays of its own).
pub(super) struct Scorer {
    program: Program,
    /// Per input: a parameter by name, or None for `input_ids`.
    inputs: Vec<Option<String>>,
    ids_spec: PartitionSpec,
    /// A reference adapter's tensors, placed once.
    own: HashMap<String, DeviceArray>,
}

impl Scorer {
    /// Per-token log-probs at `temperature` of the session's model, with
    /// the session's own LoRA tensors (`policy`), or else with `adapter`'s
    /// (placed here once), or else the base alone.
    pub(super) fn new(
        session: &Session,
        policy: bool,
        adapter: Option<&Adapter>,
        temperature: f64,
    ) -> Result<Scorer> {
        let tc = session.config();
        let config = &session.model().config;
        let lora = if policy {
            tc.lora.clone()
        } else {
            adapter.map(|a| a.lora.clone())
        };
        let step = token_logps_step(config, tc, lora.as_ref(), temperature)?;
        let backend = session.backend();
        let mesh = backend.mesh();
        let rules = partition_rules(config);
        let mut own = HashMap::new();
        if let (Some(a), Some(l), false) = (adapter, &lora, policy) {
            for (name, ty) in lora_parameter_types(config, l) {
                let spec = rules.spec_for(&name, ty.rank());
                let lit = a
                    .get(&name)
                    .ok_or_else(|| {
                        EngineError::Internal(format!("the reference adapter has no {name}"))
                    })?
                    .clone();
                let lit = if lit.ty.dtype != ty.dtype {
                    Literal::from_f64s(ty.clone(), &lit.to_f64s())
                } else {
                    lit
                };
                own.insert(name, backend.place(&HostArray::from(lit), &spec)?);
            }
        }
        let f = &step.function;
        let spec_of = |name: &str| -> Option<PartitionSpec> {
            own.get(name)
                .or_else(|| session.array(name))
                .map(|a| a.sharding().spec.clone())
        };
        if let Some((k, _)) = step.inputs.iter().enumerate().find(|(k, i)| {
            !matches!(i.role, Role::Batch(_)) && spec_of(&f.inputs[*k].name).is_none()
        }) {
            return Err(EngineError::Internal(format!(
                "the rollouts' scoring program reads {}, which the session does not hold",
                f.inputs[k].name
            )));
        }
        let sharded = ShardedStep::with_layout(&step, mesh, |k| match step.inputs[k].role {
            Role::Batch(_) => rules.spec_for(&f.inputs[k].name, 2),
            _ => spec_of(&f.inputs[k].name).unwrap_or_else(PartitionSpec::replicated),
        });
        let program = sharded.compile(backend, hlo_runtime::Mode::Jit)?;
        let inputs = f
            .inputs
            .iter()
            .enumerate()
            .map(|(k, b)| match step.inputs[k].role {
                Role::Batch(_) => None,
                _ => Some(b.name.clone()),
            })
            .collect();
        let ids_spec = rules.spec_for("input_ids", 2);
        Ok(Scorer {
            program,
            inputs,
            ids_spec,
            own,
        })
    }

    /// The per-token log-probs of `ids` (`[rows, seq]`), row-major.
    pub(super) fn score(
        &self,
        session: &Session,
        ids: &[i32],
        rows: usize,
        seq: usize,
    ) -> Result<Vec<f32>> {
        let backend = session.backend();
        let placed = backend.place(
            &HostArray::new(&[rows as i64, seq as i64], ids)?,
            &self.ids_spec,
        )?;
        let args = self
            .inputs
            .iter()
            .map(|w| match w {
                None => Ok(&placed),
                Some(name) => self
                    .own
                    .get(name)
                    .or_else(|| session.array(name))
                    .ok_or_else(|| EngineError::Internal(format!("no array for {name}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let out = self.program.run(&args)?;
        Ok(out[0]
            .gather()?
            .to_f64_vec()
            .into_iter()
            .map(|v| v as f32)
            .collect())
    }
}
