//! `hlo-e2e` holds the cross-crate end-to-end tests: a model traced in
//! `hlo-models`, lowered by `hlo-lowering`, sharded by `hlo-partitioner` and
//! run by `hlo-runtime` on the real CPU plugin with virtual devices, checked
//! against independent references (host f64, HF/PEFT/JAX fixtures). Until the
//! model crates land, its tests run hand-written sharded programs through the
//! runtime. Tests that need the plugin fail loudly without it: `make test`
//! installs it.
