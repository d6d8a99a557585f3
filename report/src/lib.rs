//! `hlo-report` turns what a training run logged into something to look
//! at. It owns:
//!
//! - [`metrics`]: reading back a run's metrics file (the JSON Lines that
//!   `hlo-train train --metrics` writes) as [`LossCurves`].
//! - [`plot`]: the loss chart as one self-contained SVG file
//!   ([`write_loss_svg`]).
//! - [`tensorboard`]: TensorBoard event files ([`EventWriter`]), written
//!   without TensorFlow or a protobuf crate.
//!
//! It does not run, compile or train anything and depends on no crate of
//! this workspace: the `hlo-train` CLI decides what to log, writes the
//! metrics file's lines and calls in here. Its errors are [`ReportError`].

mod error;
mod fs;
pub mod metrics;
pub mod plot;
pub mod tensorboard;

pub use error::{ReportError, Result};
pub use metrics::LossCurves;
pub use plot::{chart_svg, loss_svg, write_loss_svg, Labels};
pub use tensorboard::EventWriter;

/// A fresh folder of the test's own under the system's temporary folder.
#[cfg(test)]
pub(crate) fn temp_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("hlo-report-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
