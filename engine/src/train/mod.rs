//! Training: the step compiled with its state on the devices
//! ([`session`]), the loop ([`trainer`]) reporting through [`hooks`], and
//! saving and resuming ([`checkpoint`]).

pub mod checkpoint;
pub mod hooks;
pub mod session;
pub mod trainer;
