//! The hardware hlo-train plans and measures against, in one table: per
//! device kind, its dense peak, its memory and its links, from the
//! vendors' data sheets; and the host the command runs on, whose memory is
//! read from `/proc/meminfo` and whose peak `flops` measures. MFU
//! (`flops`), link times (`comm`) and `hlo-train plan` (memory, compute
//! time) all read it.
//!
//! ```
//! use hlo_engine::hardware::{lookup, Kind};
//! let h100 = lookup("NVIDIA H100 80GB HBM3").unwrap();
//! assert_eq!(h100.kind, Kind::H100);
//! assert_eq!(h100.peak_tflops(hlo_ir::DType::BF16), Some(989.0));
//! assert_eq!(lookup("rtx4090").unwrap().memory_bytes(), Some(24_000_000_000));
//! assert_eq!(lookup("cpu").unwrap().peak_tflops(hlo_ir::DType::F32), None);
//! ```

use hlo_ir::DType;

/// A device kind of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Mi300x,
    /// One GCD of an MI250 (PJRT lists each of its two dies as a device).
    Mi250Gcd,
    H100,
    H200,
    A100,
    Rtx4090,
    /// The CPU of the host the command runs on.
    Host,
}

impl Kind {
    /// Every kind, in the table's order.
    pub const ALL: [Kind; 7] = [
        Kind::Mi300x,
        Kind::Mi250Gcd,
        Kind::H100,
        Kind::H200,
        Kind::A100,
        Kind::Rtx4090,
        Kind::Host,
    ];

    /// The kind's entry of [`DEVICES`].
    pub fn device(self) -> &'static Device {
        // DEVICES lists the kinds in declaration order (a test checks).
        &DEVICES[self as usize]
    }
}

/// A device's links, per direction, in GB/s (10⁹ bytes a second).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interconnect {
    /// To the other devices of its node, all links together.
    pub within_node_gbs: f64,
    /// To other nodes: the device's share of the node's NICs.
    pub across_nodes_gbs: f64,
}

impl Interconnect {
    /// The bandwidth of the slowest link a group uses: the NIC's when the
    /// group spans nodes, else the node's own links.
    pub fn link_gbs(self, crosses_nodes: bool) -> f64 {
        if crosses_nodes {
            self.across_nodes_gbs
        } else {
            self.within_node_gbs
        }
    }
}

/// A data sheet's figures for one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Datasheet {
    /// Dense (no sparsity) bf16 peak TFLOP/s; f32 counts half.
    pub bf16_tflops: f64,
    /// Memory of one device in bytes (GB of 10⁹ bytes, as data sheets
    /// count).
    pub memory_bytes: u64,
    pub links: Interconnect,
}

/// Where a kind's figures come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Figures {
    Datasheet(Datasheet),
    /// The host: memory from `/proc/meminfo`, the peak measured
    /// (`flops::measure_tflops`), no links (its devices are virtual, in
    /// one process).
    Host,
}

/// One entry of the table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Device {
    pub kind: Kind,
    /// The kind's name in tables and messages (`MI300X`, `RTX 4090`).
    pub name: &'static str,
    /// What one device is, in words (`MI250 (one GCD)`, `this host`).
    pub label: &'static str,
    /// The kind as `hlo-train plan --target` names it (`rtx4090`).
    pub target: &'static str,
    /// Upper-case parts of the device kind a PJRT plugin reports that name
    /// this kind (`NVIDIA H100 80GB HBM3` holds `H100`).
    pub pjrt: &'static [&'static str],
    pub figures: Figures,
}

impl Device {
    /// The data sheet's dense peak TFLOP/s of one device for `dtype` (the
    /// bf16 figure, half for f32); None for the host, whose peak is
    /// measured instead.
    pub fn peak_tflops(&self, dtype: DType) -> Option<f64> {
        match self.figures {
            Figures::Datasheet(d) if dtype == DType::F32 => Some(d.bf16_tflops / 2.0),
            Figures::Datasheet(d) => Some(d.bf16_tflops),
            Figures::Host => None,
        }
    }

    /// Memory of one device in bytes: the data sheet's, or the host's
    /// `MemTotal` (None when `/proc/meminfo` cannot be read).
    pub fn memory_bytes(&self) -> Option<u64> {
        match self.figures {
            Figures::Datasheet(d) => Some(d.memory_bytes),
            Figures::Host => host_memory_bytes(),
        }
    }

    /// The documented peak rates of the device's links (None for the
    /// host).
    pub fn links(&self) -> Option<Interconnect> {
        match self.figures {
            Figures::Datasheet(d) => Some(d.links),
            Figures::Host => None,
        }
    }
}

const GB: u64 = 1_000_000_000;

/// Across nodes for MI300X, H100 and H200: one 400 Gb/s NIC per GPU
/// (InfiniBand NDR or 400 GbE RoCE, as in NVIDIA DGX H100/H200 and AMD
/// MI300X platforms' eight-NIC nodes), 50 GB/s each way.
const NIC_400G_GBS: f64 = 50.0;

/// The table, one entry per [`Kind`] in its order. Peaks are dense bf16
/// (sparsity's doubled figures left out); links are per direction (a data
/// sheet's bidirectional figure halved).
pub const DEVICES: [Device; 7] = [
    Device {
        kind: Kind::Mi300x,
        name: "MI300X",
        label: "MI300X",
        target: "mi300x",
        pjrt: &["MI300X"],
        // AMD Instinct MI300X data sheet: 1307.4 TFLOPS bf16 dense, 192 GB
        // HBM3, "Infinity Fabric Links 7, Peak Infinity Fabric Link
        // Bandwidth 128 GB/s": 7 links of 128 GB/s bidirectional (64 GB/s
        // each way) to the 7 other GPUs of a node, 448 GB/s each way in
        // all. A single ring uses one link each way; RCCL spreads a
        // collective over several rings.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 1307.4,
            memory_bytes: 192 * GB,
            links: Interconnect {
                within_node_gbs: 448.0,
                across_nodes_gbs: NIC_400G_GBS,
            },
        }),
    },
    Device {
        kind: Kind::Mi250Gcd,
        name: "MI250",
        label: "MI250 (one GCD)",
        target: "mi250",
        pjrt: &["MI250"],
        // AMD Instinct MI250 data sheet: 362.1 TFLOPS bf16 for the whole
        // package, its two GCDs together, so 181.05 per GCD (what PJRT
        // calls a device); 128 GB HBM2e, 64 GB per GCD. A ring over a node's 8 GCDs (4 OAM packages) takes
        // single xGMI links between packages, 50 GB/s each way (AMD CDNA 2
        // white paper: 25 GT/s × 16 bit links; the two GCDs of a package
        // share 4 links, 200 GB/s each way); across nodes one 200 Gb/s NIC
        // per package (the OLCF Frontier user guide's node: four HPE
        // Slingshot NICs, 25 GB/s each), 12.5 GB/s per GCD.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 181.05,
            memory_bytes: 64 * GB,
            links: Interconnect {
                within_node_gbs: 50.0,
                across_nodes_gbs: 12.5,
            },
        }),
    },
    Device {
        kind: Kind::H100,
        name: "H100",
        label: "H100",
        target: "h100",
        pjrt: &["H100"],
        // NVIDIA H100 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16
        // dense, 80 GB HBM3, NVLink 900 GB/s bidirectional (450 each way).
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 989.0,
            memory_bytes: 80 * GB,
            links: Interconnect {
                within_node_gbs: 450.0,
                across_nodes_gbs: NIC_400G_GBS,
            },
        }),
    },
    Device {
        kind: Kind::H200,
        name: "H200",
        label: "H200",
        target: "h200",
        pjrt: &["H200"],
        // NVIDIA H200 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16
        // dense, 141 GB HBM3e, NVLink 900 GB/s bidirectional.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 989.0,
            memory_bytes: 141 * GB,
            links: Interconnect {
                within_node_gbs: 450.0,
                across_nodes_gbs: NIC_400G_GBS,
            },
        }),
    },
    Device {
        kind: Kind::A100,
        name: "A100",
        label: "A100",
        target: "a100",
        pjrt: &["A100"],
        // NVIDIA A100 Tensor Core GPU data sheet, the 80 GB SXM part: 312
        // TFLOPS bf16 dense, 80 GB HBM2e, NVLink 600 GB/s bidirectional
        // (300 each way). Across nodes the NVIDIA DGX A100 data sheet's
        // node: eight 200 Gb/s HDR InfiniBand NICs, one per GPU, 25 GB/s
        // each way. (A 40 GB A100 matches this entry too.)
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 312.0,
            memory_bytes: 80 * GB,
            links: Interconnect {
                within_node_gbs: 300.0,
                across_nodes_gbs: 25.0,
            },
        }),
    },
    Device {
        kind: Kind::Rtx4090,
        name: "RTX 4090",
        label: "RTX 4090",
        target: "rtx4090",
        pjrt: &["RTX 4090"],
        // NVIDIA Ada Lovelace white paper: 165.2 TFLOPS dense bf16 with
        // fp32 accumulation, 24 GB GDDR6X. No NVLink: PCIe 4.0 x16, 32 GB/s
        // each way, and across nodes a 100 Gb/s NIC, 12.5 GB/s.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 165.2,
            memory_bytes: 24 * GB,
            links: Interconnect {
                within_node_gbs: 32.0,
                across_nodes_gbs: 12.5,
            },
        }),
    },
    Device {
        kind: Kind::Host,
        name: "cpu",
        label: "this host",
        target: "cpu",
        // PJRT's CPU plugin reports `cpu`, which `target` matches.
        pjrt: &[],
        figures: Figures::Host,
    },
];

/// The entry for a device kind as a PJRT plugin reports it (`NVIDIA H100
/// 80GB HBM3`, `cpu`) or as `--target` names it (`mi300x`, `rtx4090`),
/// case aside; None for a kind the table lacks.
pub fn lookup(kind: &str) -> Option<&'static Device> {
    let k = kind.trim().to_uppercase();
    DEVICES
        .iter()
        .find(|d| k.eq_ignore_ascii_case(d.target))
        .or_else(|| {
            DEVICES
                .iter()
                .find(|d| d.pjrt.iter().any(|part| k.contains(part)))
        })
}

/// The host's memory in bytes (`MemTotal` of `/proc/meminfo`), None when
/// it cannot be read.
pub fn host_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024).filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_entry_and_every_fact() {
        for (i, kind) in Kind::ALL.into_iter().enumerate() {
            assert_eq!(kind as usize, i);
            let d = kind.device();
            assert_eq!(d.kind, kind);
            assert!(!d.name.is_empty() && !d.label.is_empty() && !d.target.is_empty());
            match d.figures {
                Figures::Datasheet(s) => {
                    assert!(s.bf16_tflops > 0.0, "{d:?}");
                    assert!(s.memory_bytes > 0, "{d:?}");
                    assert!(s.links.within_node_gbs > 0.0, "{d:?}");
                    assert!(s.links.across_nodes_gbs > 0.0, "{d:?}");
                    // The node's own links are never slower than its NICs.
                    assert!(s.links.within_node_gbs >= s.links.across_nodes_gbs);
                    assert_eq!(d.peak_tflops(DType::BF16), Some(s.bf16_tflops));
                    assert_eq!(d.peak_tflops(DType::F32), Some(s.bf16_tflops / 2.0));
                    assert_eq!(d.memory_bytes(), Some(s.memory_bytes));
                    assert_eq!(d.links(), Some(s.links));
                    assert!(!d.pjrt.is_empty(), "{d:?}");
                }
                Figures::Host => {
                    assert_eq!(kind, Kind::Host);
                    assert_eq!(d.peak_tflops(DType::F32), None);
                    assert_eq!(d.links(), None);
                    // The tests run on Linux, which has /proc/meminfo.
                    assert!(d.memory_bytes().is_some_and(|b| b > GB / 10));
                }
            }
        }
    }

    #[test]
    fn pjrt_device_kinds_find_their_entries() {
        let cases = [
            ("AMD Instinct MI300X", Kind::Mi300x),
            ("AMD Instinct MI250X/MI250", Kind::Mi250Gcd),
            ("NVIDIA H100 80GB HBM3", Kind::H100),
            ("NVIDIA H100 PCIe", Kind::H100),
            ("NVIDIA H200", Kind::H200),
            ("NVIDIA A100-SXM4-80GB", Kind::A100),
            ("NVIDIA GeForce RTX 4090", Kind::Rtx4090),
            ("cpu", Kind::Host),
        ];
        for (pjrt, kind) in cases {
            assert_eq!(lookup(pjrt).map(|d| d.kind), Some(kind), "{pjrt}");
        }
        for unknown in ["TPU v4", "NVIDIA GeForce RTX 3090", "", "host"] {
            assert_eq!(lookup(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn target_names_find_their_entries() {
        for d in &DEVICES {
            assert_eq!(lookup(d.target).map(|e| e.kind), Some(d.kind));
            assert_eq!(
                lookup(&d.target.to_uppercase()).map(|e| e.kind),
                Some(d.kind)
            );
        }
    }

    #[test]
    fn figures_are_the_data_sheets() {
        let peak = |k: Kind| k.device().peak_tflops(DType::BF16);
        assert_eq!(peak(Kind::Mi300x), Some(1307.4));
        assert_eq!(peak(Kind::Mi250Gcd), Some(181.05));
        assert_eq!(peak(Kind::A100), Some(312.0));
        assert_eq!(Kind::Rtx4090.device().peak_tflops(DType::F32), Some(82.6));
        let mem = |k: Kind| k.device().memory_bytes();
        assert_eq!(mem(Kind::H200), Some(141_000_000_000));
        assert_eq!(mem(Kind::Mi250Gcd), Some(64_000_000_000));
        let links = |k: Kind| {
            k.device()
                .links()
                .map(|l| (l.within_node_gbs, l.across_nodes_gbs))
        };
        assert_eq!(links(Kind::Mi300x), Some((448.0, 50.0)));
        assert_eq!(links(Kind::A100), Some((300.0, 25.0)));
        let net = Kind::H100.device().links().unwrap();
        assert_eq!((net.link_gbs(false), net.link_gbs(true)), (450.0, 50.0));
    }
}
