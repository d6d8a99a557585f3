//! Figures about a step without training: memory plans ([`plan`]),
//! timing ([`bench`]), FLOPs and MFU ([`flops`]), what a step sends
//! between devices ([`comm`]), and the one table of device kinds they all
//! read ([`hardware`]).

pub mod bench;
pub mod comm;
pub mod flops;
pub mod hardware;
pub mod plan;
