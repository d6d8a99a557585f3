//! The devices a run holds: the plugin's client and the mesh
//! ([`backend`]), the one pipeline from a traced step to a compiled,
//! sharded program ([`pipeline`]), several processes as one run
//! ([`processes`]), compiling for GPUs that are not here ([`target`]), a compiled step in a file
//! ([`compiled`]), and the programs a run starts beside it (`children`).

pub mod backend;
pub(crate) mod children;
pub mod compiled;
pub mod pipeline;
pub mod processes;
pub mod target;
