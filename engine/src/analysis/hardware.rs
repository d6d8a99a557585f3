//! The hardware hlo-train plans and measures against, in one table: per
//! device kind, its dense peak, its memory and its links, from the
//! vendors' data sheets; and the host the command runs on, whose memory is
//! read from `/proc/meminfo` and whose peak `flops` measures. MFU
//! (`flops`), link times (`comm`) and `hlo-train plan` (memory, compute
//! time) all read it.
//!
//! Each GPU kind also carries its description for XLA's GPU compilers
//! ([`GpuTarget`]): a `GpuTargetConfigProto` in protobuf text format
//! (`targets/<target>.txtpb`), with which the CUDA or ROCm plugin
//! compiles for the card without one present.
//!
//! ```
//! use hlo_engine::analysis::hardware::{lookup, Kind};
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
    Mi325x,
    /// One GCD of an MI250 (PJRT lists each of its two dies as a device).
    Mi250Gcd,
    /// One GCD of an MI250X.
    Mi250xGcd,
    H100,
    H200,
    B200,
    A100,
    Rtx4090,
    /// The CPU of the host the command runs on.
    Host,
}

impl Kind {
    /// Every kind, in the table's order.
    pub const ALL: [Kind; 10] = [
        Kind::Mi300x,
        Kind::Mi325x,
        Kind::Mi250Gcd,
        Kind::Mi250xGcd,
        Kind::H100,
        Kind::H200,
        Kind::B200,
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

/// A GPU kind as XLA's GPU compilers take it when the card is not there:
/// the plugin that compiles for it and the card's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuTarget {
    /// The PJRT plugin that compiles for the kind: `cuda` or `rocm`.
    pub platform: &'static str,
    /// A `stream_executor.GpuTargetConfigProto` in protobuf text format
    /// (`targets/<target>.txtpb`): the card as XLA sees it on the device
    /// (compute capability or gfx ISA, SMs or CUs, clocks, limits, the
    /// memory the driver offers), the plugin's `target_config` option.
    pub config: &'static str,
}

impl GpuTarget {
    const fn cuda(config: &'static str) -> Option<GpuTarget> {
        Some(GpuTarget {
            platform: "cuda",
            config,
        })
    }

    const fn rocm(config: &'static str) -> Option<GpuTarget> {
        Some(GpuTarget {
            platform: "rocm",
            config,
        })
    }
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
    /// How XLA's GPU compiler takes the kind without the device; None
    /// for the host.
    pub gpu: Option<GpuTarget>,
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

    /// The kind's `GpuTargetConfigProto` in protobuf text format, for a
    /// GPU plugin's `target_config` topology option; None for the host.
    pub fn gpu_target_config(&self) -> Option<&'static str> {
        self.gpu.map(|g| g.config)
    }

    /// The plugin that compiles for the kind: `cuda` or `rocm`; None for
    /// the host.
    pub(crate) fn compiler_platform(&self) -> Option<&'static str> {
        self.gpu.map(|g| g.platform)
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
pub const DEVICES: [Device; 10] = [
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
        gpu: GpuTarget::rocm(include_str!("targets/mi300x.txtpb")),
    },
    Device {
        kind: Kind::Mi325x,
        name: "MI325X",
        label: "MI325X",
        target: "mi325x",
        pjrt: &["MI325X"],
        // AMD Instinct MI325X data sheet: the MI300X's CDNA 3 chip (304
        // CUs, gfx942) with 256 GB HBM3E at 6 TB/s; 1307.4 TFLOPS bf16
        // dense; the same 7 Infinity Fabric links of 128 GB/s
        // bidirectional, 448 GB/s each way in all, and the same eight-NIC
        // nodes as the MI300X's platform.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 1307.4,
            memory_bytes: 256 * GB,
            links: Interconnect {
                within_node_gbs: 448.0,
                across_nodes_gbs: NIC_400G_GBS,
            },
        }),
        gpu: GpuTarget::rocm(include_str!("targets/mi325x.txtpb")),
    },
    Device {
        kind: Kind::Mi250Gcd,
        name: "MI250",
        label: "MI250 (one GCD)",
        target: "mi250",
        // ROCm names both the MI250 and the MI250X `AMD Instinct
        // MI250X/MI250`, which this entry, before the MI250X's, takes.
        pjrt: &["MI250"],
        // AMD Instinct MI250 data sheet: 362.1 TFLOPS bf16 for the whole
        // package, its two GCDs together, so 181.05 per GCD (what PJRT
        // calls a device); 128 GB HBM2e, 64 GB per GCD. A ring over a
        // node's 8 GCDs (4 OAM packages) takes single xGMI links between
        // packages, 50 GB/s each way (AMD CDNA 2 white paper: 25 GT/s × 16
        // bit links; the two GCDs of a package share 4 links, 200 GB/s
        // each way); across nodes one 200 Gb/s NIC per package (the OLCF
        // Frontier user guide's node: four HPE Slingshot NICs, 25 GB/s
        // each), 12.5 GB/s per GCD.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 181.05,
            memory_bytes: 64 * GB,
            links: Interconnect {
                within_node_gbs: 50.0,
                across_nodes_gbs: 12.5,
            },
        }),
        gpu: GpuTarget::rocm(include_str!("targets/mi250.txtpb")),
    },
    Device {
        kind: Kind::Mi250xGcd,
        name: "MI250X",
        label: "MI250X (one GCD)",
        target: "mi250x",
        // None of its own: ROCm reports `AMD Instinct MI250X/MI250` for
        // both parts, which finds the MI250's entry; `--target mi250x`
        // names this one.
        pjrt: &[],
        // AMD Instinct MI250X data sheet: 383.0 TFLOPS bf16 for the
        // package (220 CUs against the MI250's 208), 191.5 per GCD; 128
        // GB HBM2e, 64 GB per GCD. Links as the MI250's (whose figures
        // come from Frontier's node, of four MI250X): single 50 GB/s
        // xGMI links between packages within a node, one 25 GB/s NIC per
        // package across nodes, 12.5 GB/s per GCD.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 191.5,
            memory_bytes: 64 * GB,
            links: Interconnect {
                within_node_gbs: 50.0,
                across_nodes_gbs: 12.5,
            },
        }),
        gpu: GpuTarget::rocm(include_str!("targets/mi250x.txtpb")),
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
        gpu: GpuTarget::cuda(include_str!("targets/h100.txtpb")),
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
        gpu: GpuTarget::cuda(include_str!("targets/h200.txtpb")),
    },
    Device {
        kind: Kind::B200,
        name: "B200",
        label: "B200",
        target: "b200",
        // Also a GB200's GPU (`NVIDIA GB200`), the same chip run at a
        // higher power limit: its figures are somewhat above these.
        pjrt: &["B200"],
        // NVIDIA HGX B200 data sheet (eight GPUs at 1000 W): FP16/BF16
        // tensor 36 PFLOPS with sparsity, 4.5 per GPU, 2250 TFLOPS dense;
        // NVIDIA DGX B200 data sheet: 1,440 GB of GPU memory, 180 GB
        // HBM3e per GPU; fifth-generation NVLink, 1.8 TB/s bidirectional
        // per GPU (900 GB/s each way); across nodes eight 400 Gb/s
        // ConnectX-7 NICs, one per GPU.
        figures: Figures::Datasheet(Datasheet {
            bf16_tflops: 2250.0,
            memory_bytes: 180 * GB,
            links: Interconnect {
                within_node_gbs: 900.0,
                across_nodes_gbs: NIC_400G_GBS,
            },
        }),
        gpu: GpuTarget::cuda(include_str!("targets/b200.txtpb")),
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
        gpu: GpuTarget::cuda(include_str!("targets/a100.txtpb")),
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
        gpu: GpuTarget::cuda(include_str!("targets/rtx4090.txtpb")),
    },
    Device {
        kind: Kind::Host,
        name: "cpu",
        label: "this host",
        target: "cpu",
        // PJRT's CPU plugin reports `cpu`, which `target` matches.
        pjrt: &[],
        figures: Figures::Host,
        gpu: None,
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
pub(crate) fn host_memory_bytes() -> Option<u64> {
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
                    // Every kind but the MI250X, whose name ROCm shares
                    // with the MI250, is found by what PJRT reports.
                    assert!(!d.pjrt.is_empty() || kind == Kind::Mi250xGcd, "{d:?}");
                    // Every GPU of the table has its compiler description.
                    let gpu = d.gpu.expect("a GPU kind's target config");
                    assert_eq!(d.gpu_target_config(), Some(gpu.config));
                    assert_eq!(d.compiler_platform(), Some(gpu.platform));
                    assert!(["cuda", "rocm"].contains(&gpu.platform), "{d:?}");
                }
                Figures::Host => {
                    assert_eq!(kind, Kind::Host);
                    assert_eq!(d.peak_tflops(DType::F32), None);
                    assert_eq!(d.links(), None);
                    assert_eq!((d.gpu_target_config(), d.compiler_platform()), (None, None));
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
            ("AMD Instinct MI325X", Kind::Mi325x),
            // ROCm's name for both the MI250 and the MI250X.
            ("AMD Instinct MI250X/MI250", Kind::Mi250Gcd),
            ("NVIDIA H100 80GB HBM3", Kind::H100),
            ("NVIDIA H100 PCIe", Kind::H100),
            ("NVIDIA H200", Kind::H200),
            ("NVIDIA B200", Kind::B200),
            ("NVIDIA A100-SXM4-80GB", Kind::A100),
            ("NVIDIA GeForce RTX 4090", Kind::Rtx4090),
            ("cpu", Kind::Host),
        ];
        for (pjrt, kind) in cases {
            assert_eq!(lookup(pjrt).map(|d| d.kind), Some(kind), "{pjrt}");
        }
        for unknown in ["TPU v4", "NVIDIA GeForce RTX 3090", "", "host", "MI355X"] {
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
        let targets: Vec<&str> = DEVICES.iter().map(|d| d.target).collect();
        assert_eq!(
            targets,
            [
                "mi300x", "mi325x", "mi250", "mi250x", "h100", "h200", "b200", "a100", "rtx4090",
                "cpu"
            ]
        );
    }

    #[test]
    fn figures_are_the_data_sheets() {
        let peak = |k: Kind| k.device().peak_tflops(DType::BF16);
        assert_eq!(peak(Kind::Mi300x), Some(1307.4));
        assert_eq!(peak(Kind::Mi325x), Some(1307.4));
        assert_eq!(peak(Kind::Mi250Gcd), Some(181.05));
        assert_eq!(peak(Kind::Mi250xGcd), Some(191.5));
        assert_eq!(peak(Kind::B200), Some(2250.0));
        assert_eq!(peak(Kind::A100), Some(312.0));
        assert_eq!(Kind::Rtx4090.device().peak_tflops(DType::F32), Some(82.6));
        let mem = |k: Kind| k.device().memory_bytes();
        assert_eq!(mem(Kind::H200), Some(141_000_000_000));
        assert_eq!(mem(Kind::Mi325x), Some(256_000_000_000));
        assert_eq!(mem(Kind::B200), Some(180_000_000_000));
        assert_eq!(mem(Kind::Mi250Gcd), Some(64_000_000_000));
        assert_eq!(mem(Kind::Mi250xGcd), Some(64_000_000_000));
        let links = |k: Kind| {
            k.device()
                .links()
                .map(|l| (l.within_node_gbs, l.across_nodes_gbs))
        };
        assert_eq!(links(Kind::Mi300x), Some((448.0, 50.0)));
        assert_eq!(links(Kind::Mi325x), Some((448.0, 50.0)));
        assert_eq!(links(Kind::Mi250xGcd), Some((50.0, 12.5)));
        assert_eq!(links(Kind::B200), Some((900.0, 50.0)));
        assert_eq!(links(Kind::A100), Some((300.0, 25.0)));
        let net = Kind::H100.device().links().unwrap();
        assert_eq!((net.link_gbs(false), net.link_gbs(true)), (450.0, 50.0));
    }

    /// A value of a protobuf text-format message.
    #[derive(Debug)]
    enum Value {
        /// A number or an enum's name.
        Word(String),
        /// A string, its quotes removed.
        Str(String),
        Message(Vec<(String, Value)>),
    }

    #[derive(Debug, PartialEq)]
    enum Token {
        Open,
        Close,
        Colon,
        Word(String),
        Str(String),
    }

    /// Protobuf text format as far as the target configs use it: `#`
    /// comments, `name: scalar`, `name { ... }`, strings without
    /// escapes.
    fn parse_text_proto(text: &str) -> Vec<(String, Value)> {
        let mut tokens = Vec::new();
        for line in text.lines() {
            let mut chars = line.chars().peekable();
            while let Some(&c) = chars.peek() {
                match c {
                    '#' => break,
                    '{' | '}' | ':' => {
                        chars.next();
                        tokens.push(match c {
                            '{' => Token::Open,
                            '}' => Token::Close,
                            _ => Token::Colon,
                        });
                    }
                    '"' => {
                        chars.next();
                        let s: String = chars.by_ref().take_while(|&c| c != '"').collect();
                        tokens.push(Token::Str(s));
                    }
                    c if c.is_whitespace() => {
                        chars.next();
                    }
                    _ => {
                        let mut s = String::new();
                        while let Some(&c) = chars.peek() {
                            if c.is_whitespace() || "{}:#\"".contains(c) {
                                break;
                            }
                            s.push(c);
                            chars.next();
                        }
                        tokens.push(Token::Word(s));
                    }
                }
            }
        }
        let mut tokens = tokens.into_iter().peekable();
        let fields = parse_fields(&mut tokens);
        assert_eq!(tokens.next(), None, "a `}}` too many");
        fields
    }

    fn parse_fields(
        tokens: &mut std::iter::Peekable<std::vec::IntoIter<Token>>,
    ) -> Vec<(String, Value)> {
        let mut fields = Vec::new();
        while let Some(t) = tokens.peek() {
            if *t == Token::Close {
                break;
            }
            let Some(Token::Word(name)) = tokens.next() else {
                panic!("a field name expected");
            };
            if tokens.peek() == Some(&Token::Colon) {
                tokens.next();
            }
            let value = match tokens.next() {
                Some(Token::Open) => {
                    let m = parse_fields(tokens);
                    assert_eq!(tokens.next(), Some(Token::Close), "{name} is not closed");
                    Value::Message(m)
                }
                Some(Token::Word(w)) => Value::Word(w),
                Some(Token::Str(s)) => Value::Str(s),
                other => panic!("{name}: no value but {other:?}"),
            };
            fields.push((name, value));
        }
        fields
    }

    /// A message's fields: name, and the field's message (None: scalar).
    type Fields = &'static [(&'static str, Option<&'static str>)];

    /// The messages of `GpuTargetConfigProto` and their fields, as the
    /// plugins' `xla/stream_executor/device_description.proto` has them
    /// (jax-cuda13-pjrt 0.12.1, jax-rocm7-pjrt 0.12.0): each field's
    /// message, or None for a scalar. A name not here would be dropped by
    /// the plugin without a word (a top-level `dnn_version_info` was).
    const SCHEMA: &[(&str, Fields)] = &[
        (
            "GpuTargetConfigProto",
            &[
                ("gpu_device_info", Some("GpuDeviceInfoProto")),
                ("platform_name", None),
                ("runtime_version", Some("RuntimeVersionProto")),
                ("device_description_str", None),
            ],
        ),
        (
            "GpuDeviceInfoProto",
            &[
                ("device_vendor", None),
                ("platform_version", None),
                ("pci_bus_id", None),
                ("name", None),
                ("model_str", None),
                ("threads_per_block_limit", None),
                ("threads_per_warp", None),
                ("shared_memory_per_block", None),
                ("shared_memory_per_core", None),
                ("threads_per_core_limit", None),
                ("core_count", None),
                ("fpus_per_core", None),
                ("block_dim_limit_x", None),
                ("block_dim_limit_y", None),
                ("block_dim_limit_z", None),
                ("memory_bandwidth", None),
                ("l2_cache_size", None),
                ("clock_rate_ghz", None),
                ("device_memory_size", None),
                ("shared_memory_per_block_optin", None),
                (
                    "cuda_compute_capability",
                    Some("CudaComputeCapabilityProto"),
                ),
                (
                    "rocm_compute_capability",
                    Some("RocmComputeCapabilityProto"),
                ),
                ("registers_per_core_limit", None),
                ("registers_per_block_limit", None),
                (
                    "scalar_unit_description",
                    Some("ExecutionUnitDescriptionProto"),
                ),
                (
                    "matrix_unit_description",
                    Some("ExecutionUnitDescriptionProto"),
                ),
                ("driver_version", None),
                ("kernel_mode_driver_version", None),
                ("runtime_version", None),
                ("compile_time_toolkit_version", None),
                ("dnn_version", None),
                ("cub_version", None),
                (
                    "device_interconnect_info",
                    Some("DeviceInterconnectInfoProto"),
                ),
                ("numa_node", None),
                ("thread_dim_limit_x", None),
                ("thread_dim_limit_y", None),
                ("thread_dim_limit_z", None),
                ("device_address_bits", None),
                ("pcie_bandwidth", None),
                ("ecc_enabled", None),
                ("mem_clock_ghz", None),
                ("reserved_shared_memory_per_block", None),
                ("max_blocks_per_multiprocessor", None),
                ("collective_memory_granularity", None),
                ("oversized_shared_memory_per_block", None),
                ("confidential_computing_enabled", None),
            ],
        ),
        (
            "CudaComputeCapabilityProto",
            &[
                ("major", None),
                ("minor", None),
                ("feature_extension", None),
            ],
        ),
        ("RocmComputeCapabilityProto", &[("gcn_arch_name", None)]),
        (
            "ExecutionUnitDescriptionProto",
            &[("rate_infos", Some("RateInfosEntry"))],
        ),
        (
            "RateInfosEntry",
            &[("key", None), ("value", Some("RateInfoProto"))],
        ),
        (
            "RateInfoProto",
            &[
                ("clock_rate_ghz", None),
                ("units_per_core", None),
                ("ops_per_clock", None),
            ],
        ),
        (
            "DeviceInterconnectInfoProto",
            &[
                ("active_links", None),
                ("cluster_uuid", None),
                ("clique_id", None),
            ],
        ),
        (
            "RuntimeVersionProto",
            &[("major", None), ("minor", None), ("patch", None)],
        ),
    ];

    /// Panics unless every field of `fields` is one of `message`'s, of its
    /// kind (scalar or message), and set once (but map entries).
    fn check_schema(fields: &[(String, Value)], message: &str, at: &str) {
        let (_, known) = SCHEMA
            .iter()
            .find(|(m, _)| *m == message)
            .unwrap_or_else(|| panic!("{message} is not in the schema"));
        for (i, (name, value)) in fields.iter().enumerate() {
            let Some((_, child)) = known.iter().find(|(f, _)| f == name) else {
                panic!("{at}: {message} has no field `{name}`");
            };
            if name != "rate_infos" {
                assert!(
                    !fields[..i].iter().any(|(n, _)| n == name),
                    "{at}: `{name}` set twice"
                );
            }
            match (child, value) {
                (Some(m), Value::Message(inner)) => check_schema(inner, m, &format!("{at}.{name}")),
                (None, Value::Word(_) | Value::Str(_)) => {}
                _ => panic!("{at}: `{name}` has a value of the wrong kind: {value:?}"),
            }
        }
    }

    /// The value at a dotted path of singular fields.
    fn get<'a>(fields: &'a [(String, Value)], path: &str) -> Option<&'a Value> {
        let (first, rest) = match path.split_once('.') {
            Some((f, r)) => (f, Some(r)),
            None => (path, None),
        };
        let value = &fields.iter().find(|(n, _)| n == first)?.1;
        match (rest, value) {
            (None, v) => Some(v),
            (Some(r), Value::Message(inner)) => get(inner, r),
            (Some(_), _) => None,
        }
    }

    fn word<'a>(fields: &'a [(String, Value)], path: &str) -> Option<&'a str> {
        match get(fields, path)? {
            Value::Word(w) => Some(w),
            other => panic!("{path} is not a number or an enum: {other:?}"),
        }
    }

    fn string<'a>(fields: &'a [(String, Value)], path: &str) -> Option<&'a str> {
        match get(fields, path)? {
            Value::Str(s) => Some(s),
            other => panic!("{path} is not a string: {other:?}"),
        }
    }

    fn number(fields: &[(String, Value)], path: &str) -> f64 {
        word(fields, path)
            .unwrap_or_else(|| panic!("{path} is missing"))
            .parse()
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// XLA's element type number for BF16 (xla_data.proto's
    /// `PrimitiveType`), the key of its rates in a unit description.
    const BF16_KEY: &str = "16";

    /// Dense bf16 FLOPs of the device as its config describes it: SMs or
    /// CUs × clock × bf16 FLOPs per core and clock. Where the config has
    /// tensor-core rates (NVIDIA's data-centre cards, as XLA records
    /// them) these give the FLOPs per clock (4 tensor cores per SM × their
    /// multiply-adds × 2) and the clock they run at; elsewhere the
    /// architecture's figure, from the vendors' white papers: AMD CDNA 3,
    /// 2048 per CU; CDNA 2, 1024 per CU; NVIDIA Ada with fp32
    /// accumulation, as GeForce cards run it, 512 per SM.
    fn config_bf16_tflops(kind: Kind, info: &[(String, Value)]) -> f64 {
        let cores = number(info, "core_count");
        let tensor = match get(info, "matrix_unit_description") {
            Some(Value::Message(rates)) => rates.iter().find_map(|(_, entry)| match entry {
                Value::Message(e) if word(e, "key") == Some(BF16_KEY) => Some(e),
                _ => None,
            }),
            _ => None,
        };
        let (per_core_clock, ghz) = match tensor {
            Some(e) => (
                number(e, "value.units_per_core") * number(e, "value.ops_per_clock") * 2.0,
                number(e, "value.clock_rate_ghz"),
            ),
            None => {
                let per_clock = match kind {
                    Kind::Mi300x | Kind::Mi325x => 2048.0,
                    Kind::Mi250Gcd | Kind::Mi250xGcd => 1024.0,
                    Kind::Rtx4090 => 512.0,
                    _ => panic!("{kind:?}: no bf16 tensor rates in its config"),
                };
                (per_clock, number(info, "clock_rate_ghz"))
            }
        };
        cores * per_core_clock * ghz / 1e3
    }

    /// What the compiler targets for each GPU kind: the plugin, and the
    /// ISA (CUDA's compute capability with its feature extension, or
    /// ROCm's gfx target with its features).
    fn expected_target(kind: Kind) -> (&'static str, &'static str) {
        match kind {
            Kind::Mi300x | Kind::Mi325x => ("rocm", "gfx942:sramecc+:xnack-"),
            Kind::Mi250Gcd | Kind::Mi250xGcd => ("rocm", "gfx90a:sramecc+:xnack-"),
            Kind::H100 | Kind::H200 => ("cuda", "sm_90a"),
            Kind::B200 => ("cuda", "sm_100a"),
            Kind::A100 => ("cuda", "sm_80"),
            Kind::Rtx4090 => ("cuda", "sm_89"),
            Kind::Host => panic!("the host has no GPU target"),
        }
    }

    #[test]
    fn gpu_target_configs_describe_their_kinds() {
        let mut cuda_versions = Vec::new();
        for d in DEVICES.iter().filter(|d| d.gpu.is_some()) {
            let (kind, config) = (d.kind, d.gpu_target_config().unwrap());
            let top = parse_text_proto(config);
            check_schema(&top, "GpuTargetConfigProto", d.target);
            let Some(Value::Message(info)) = get(&top, "gpu_device_info") else {
                panic!("{kind:?}: no gpu_device_info");
            };

            // The plugin, the platform the config names, the ISA.
            let (platform, isa) = expected_target(kind);
            assert_eq!(d.compiler_platform(), Some(platform), "{kind:?}");
            let platform_name = string(&top, "platform_name");
            let found = config_isa(kind, platform_name, info);
            assert_eq!(
                platform_name.map(str::to_lowercase).as_deref(),
                Some(platform)
            );
            assert_eq!(found, isa, "{kind:?}");
            let warp = if platform == "cuda" { 32.0 } else { 64.0 };
            assert_eq!(number(info, "threads_per_warp"), warp, "{kind:?}");

            // The card's name, as its driver reports it, finds the entry
            // (but the MI250X's: ROCm gives both GCDs one name).
            let card = string(&top, "device_description_str").unwrap();
            assert!(card.to_uppercase().contains(d.name), "{card} for {kind:?}");
            let found = if kind == Kind::Mi250xGcd {
                Kind::Mi250Gcd
            } else {
                kind
            };
            assert_eq!(lookup(card).map(|e| e.kind), Some(found), "{card}");
            if platform == "cuda" {
                assert_eq!(string(info, "name"), Some(card), "{kind:?}");
            }

            check_memory(d, info);
            check_peak(d, info);
            if platform == "cuda" {
                cuda_versions.push(cuda_stack(kind, info));
            }
        }
        assert_eq!(cuda_versions.len(), 5);
        assert!(cuda_versions.windows(2).all(|w| w[0] == w[1]));
    }

    /// The ISA a config names: `sm_90a`, `gfx942:sramecc+:xnack-`.
    fn config_isa(kind: Kind, platform_name: Option<&str>, info: &[(String, Value)]) -> String {
        match platform_name {
            Some("CUDA") => {
                let extension = match word(info, "cuda_compute_capability.feature_extension") {
                    Some("ACCELERATED_FEATURES") => "a",
                    Some("NONE") => "",
                    other => panic!("{kind:?}: feature extension {other:?} (set it)"),
                };
                format!(
                    "sm_{}{}{extension}",
                    number(info, "cuda_compute_capability.major"),
                    number(info, "cuda_compute_capability.minor"),
                )
            }
            Some("ROCM") => string(info, "rocm_compute_capability.gcn_arch_name")
                .unwrap()
                .to_string(),
            other => panic!("{kind:?}: platform_name {other:?}"),
        }
    }

    /// Memory: the data sheets' "GB" of HBM or GDDR are binary (GiB), and
    /// the driver offers all but a little of it (ROCm keeps back 16 MiB,
    /// CUDA up to 1.5%): between 98% and all of the GiB, and never under
    /// the table's GB of 10⁹ bytes.
    fn check_memory(d: &Device, info: &[(String, Value)]) {
        let kind = d.kind;
        let Figures::Datasheet(sheet) = d.figures else {
            unreachable!()
        };
        let offered = number(info, "device_memory_size") as u64;
        let gib = sheet.memory_bytes / GB * (1 << 30);
        assert!(
            offered <= gib && offered as f64 >= 0.98 * gib as f64,
            "{kind:?}: {offered} bytes against {gib}"
        );
        assert!(offered >= sheet.memory_bytes, "{kind:?}");
    }

    /// The compute the config describes is the data sheet's dense bf16
    /// peak: exactly (to the sheet's rounding), but for the B200, whose
    /// tensor clock in XLA's description (1.835 GHz) gives 2225 TFLOP/s
    /// against the sheet's 2250.
    fn check_peak(d: &Device, info: &[(String, Value)]) {
        let (kind, Figures::Datasheet(sheet)) = (d.kind, d.figures) else {
            unreachable!()
        };
        let derived = config_bf16_tflops(kind, info);
        let within = if kind == Kind::B200 { 0.012 } else { 0.001 };
        assert!(
            (derived / sheet.bf16_tflops - 1.0).abs() < within,
            "{kind:?}: the config gives {derived:.1} TFLOP/s, the sheet {}",
            sheet.bf16_tflops
        );
    }

    /// CUDA: the host's software versions, as strings inside
    /// gpu_device_info (where this XLA reads them), each `a.b.c`.
    fn cuda_stack(kind: Kind, info: &[(String, Value)]) -> Vec<String> {
        let versions: Vec<String> = [
            "driver_version",
            "runtime_version",
            "compile_time_toolkit_version",
            "dnn_version",
        ]
        .iter()
        .map(|f| {
            let v = string(info, f).unwrap_or_else(|| panic!("{kind:?}: no {f}"));
            v.to_string()
        })
        .collect();
        for v in &versions {
            let parts: Vec<&str> = v.split('.').collect();
            assert!(
                parts.len() == 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()),
                "{kind:?}: version {v}"
            );
        }
        versions
    }

    #[test]
    fn the_schema_check_catches_what_the_plugin_would_drop() {
        let dropped = "gpu_device_info { core_count: 1 }\ndnn_version_info { major: 9 }\n";
        let fields = parse_text_proto(dropped);
        let caught = std::panic::catch_unwind(|| check_schema(&fields, "GpuTargetConfigProto", ""));
        assert!(caught.is_err());
        let misspelt = parse_text_proto("gpu_device_info { core_cout: 1 }");
        let caught =
            std::panic::catch_unwind(|| check_schema(&misspelt, "GpuTargetConfigProto", ""));
        assert!(caught.is_err());
        let fine = parse_text_proto("gpu_device_info { core_count: 1 } # a comment\n");
        check_schema(&fine, "GpuTargetConfigProto", "");
        assert_eq!(word(&fine, "gpu_device_info.core_count"), Some("1"));
    }
}
