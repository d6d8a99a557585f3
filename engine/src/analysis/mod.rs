//! Figures about a step without training: memory plans ([`plan`]),
//! timing ([`bench`](mod@bench)), FLOPs and MFU ([`flops`]), what a step sends
//! between devices ([`comm`]), and the one table of device kinds they all
//! read ([`hardware`]), and what a GPU compiler made of a step
//! ([`optimized`]).

pub mod bench;
pub mod comm;
pub mod flops;
pub mod hardware;
pub mod optimized;
pub mod plan;
