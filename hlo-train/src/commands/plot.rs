//! `hlo-train plot`: the loss chart of a metrics file (train loss by step,
//! eval loss at each evaluation) as a self-contained SVG, the chart `train
//! --out` ends with.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use hlo_report::write_loss_svg;

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// A metrics file written by `train --metrics` (JSON Lines).
    pub metrics: PathBuf,

    /// The SVG to write (default: loss.svg beside the metrics file).
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// The chart's title (default: "METRICS: loss").
    #[arg(long)]
    pub title: Option<String>,
}

pub fn run(args: &PlotArgs) -> Result<()> {
    let out = args.out.clone().unwrap_or_else(|| {
        args.metrics
            .parent()
            .map_or_else(|| PathBuf::from("loss.svg"), |d| d.join("loss.svg"))
    });
    let title = args
        .title
        .clone()
        .unwrap_or_else(|| format!("{}: loss", args.metrics.display()));
    write_loss_svg(&args.metrics, &out, &title)?;
    println!("wrote {}", out.display());
    Ok(())
}
