//! JIT: a traced function lowered to StableHLO, compiled once per program
//! text and compile options (a process-wide cache on the client), and run on
//! host arrays or device buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hlo_ir::rng::fingerprint;
use hlo_ir::{Function, Inputs, Outputs, TensorType};

use crate::buffer::Buffer;
use crate::client::Client;
use crate::compile_options::CompileOptions;
use crate::error::{Error, Result};
use crate::executable::LoadedExecutable;
use crate::host::HostArray;
use crate::lru::Lru;

/// One compiled program and what it was compiled from.
type CacheEntry = (String, CompileOptions, Arc<LoadedExecutable>);

/// Compiled programs of one client, by fingerprint (text kept to rule out
/// collisions), at most [`COMPILE_CACHE_CAPACITY`] of them.
pub(crate) struct CompileCache {
    entries: Mutex<Lru<u64, Vec<CacheEntry>>>,
    hits: std::sync::atomic::AtomicUsize,
    /// Executables compiled elsewhere, by the fingerprint of the program
    /// text they were compiled from ([`Client::preload`]).
    preloaded: Mutex<HashMap<u64, Arc<LoadedExecutable>>>,
}

/// Programs a client keeps compiled: far more than one run uses (a train
/// step, an eval step, a few generation buckets, or an eager run's one-op
/// programs), few enough to bound memory in a long-lived process.
pub const COMPILE_CACHE_CAPACITY: usize = 4096;

impl Default for CompileCache {
    fn default() -> Self {
        CompileCache {
            entries: Mutex::new(Lru::new(COMPILE_CACHE_CAPACITY)),
            hits: Default::default(),
            preloaded: Default::default(),
        }
    }
}

impl Client {
    /// Compiles `mlir`, or returns the executable compiled earlier for the
    /// same text and options.
    pub fn compile_cached(
        &self,
        mlir: &str,
        options: &CompileOptions,
    ) -> Result<Arc<LoadedExecutable>> {
        // Keyed by the options compiled with: clients sharing this cache
        // may carry different XLA options.
        let options = &*self.effective_options(options);
        let key = fingerprint(&[mlir.as_bytes(), &options.encode()]);
        let cache = &self.cache;
        {
            let mut entries = cache.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(list) = entries.get(&key) {
                if let Some((_, _, exe)) = list.iter().find(|(t, o, _)| t == mlir && o == options) {
                    cache
                        .hits
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Ok(exe.clone());
                }
            }
        }
        let preloaded = {
            let mut preloaded = cache.preloaded.lock().unwrap_or_else(|p| p.into_inner());
            // Hash the text only when something waits to be taken (eager
            // runs miss the cache once per op).
            match preloaded.is_empty() {
                true => None,
                false => preloaded.remove(&program_fingerprint(mlir)),
            }
        };
        let exe = match preloaded {
            Some(exe) => exe,
            None => Arc::new(self.compile(mlir, options)?),
        };
        let mut entries = cache.entries.lock().unwrap_or_else(|p| p.into_inner());
        let entry = (mlir.to_string(), options.clone(), exe.clone());
        match entries.get(&key) {
            Some(list) => list.push(entry),
            None => entries.insert(key, vec![entry]),
        }
        Ok(exe)
    }

    /// Takes `exe` (compiled elsewhere, loaded: [`Client::load_serialized`])
    /// as the program whose text has fingerprint `program`
    /// ([`program_fingerprint`]): the next compile of that text uses it
    /// instead of compiling. The caller checks that it is that program.
    pub fn preload(&self, program: u64, exe: LoadedExecutable) {
        self.cache
            .preloaded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(program, Arc::new(exe));
    }

    /// (programs compiled and cached, cache hits) so far.
    pub fn compile_cache_stats(&self) -> (usize, usize) {
        let cache = &self.cache;
        let n = cache
            .entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(Vec::len)
            .sum();
        (n, cache.hits.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The fingerprint of a program's text, as [`Client::preload`] keys it.
pub fn program_fingerprint(mlir: &str) -> u64 {
    fingerprint(&[mlir.as_bytes()])
}

/// Checks that `types` are exactly `f`'s input types, in number and
/// order: the plugin checks a buffer's byte size, not its element type or
/// dimensions, so a mismatch must be caught before execution.
pub(crate) fn check_signature<'a>(
    f: &Function,
    types: impl ExactSizeIterator<Item = &'a TensorType>,
) -> Result<()> {
    if types.len() != f.inputs.len() {
        return Err(Error::InvalidArgument(format!(
            "{} takes {} inputs, {} were given",
            f.name,
            f.inputs.len(),
            types.len()
        )));
    }
    for (b, t) in f.inputs.iter().zip(types) {
        if f.ty(b.value) != t {
            return Err(Error::InvalidArgument(format!(
                "input `{}` of {} is {}, got {t}",
                b.name,
                f.name,
                f.ty(b.value)
            )));
        }
    }
    Ok(())
}

/// A traced function compiled for one device.
///
/// ```no_run
/// use hlo_ir::{trace, DType, TensorType};
/// use hlo_runtime::{Client, ClientOptions, CompiledFunction, HostArray, Plugin, PluginSpec};
/// let client = Client::new(&Plugin::load(PluginSpec::Cpu.resolve()?)?, &ClientOptions::cpu(1))?;
/// let t = TensorType::new(DType::F32, [2]);
/// let f = trace("double", &[("x", t)], |i| i["x"] * 2.0).unwrap();
/// let exe = CompiledFunction::new(&client, &f)?;
/// let out = exe.run(&[HostArray::new(&[2], &[1.0f32, 2.5])?])?;
/// assert_eq!(out[0].to_vec::<f32>()?, vec![2.0, 5.0]);
/// # Ok::<(), hlo_runtime::Error>(())
/// ```
pub struct CompiledFunction {
    client: Client,
    function: Function,
    stablehlo: String,
    executable: Arc<LoadedExecutable>,
}

impl CompiledFunction {
    /// Simplifies (folds, CSE, DCE), lowers and compiles `f`.
    pub fn new(client: &Client, f: &Function) -> Result<Self> {
        let function = hlo_ir::simplify(f);
        let stablehlo = hlo_lowering::to_stablehlo(&function);
        let executable = client.compile_cached(&stablehlo, &CompileOptions::default())?;
        Ok(CompiledFunction {
            client: client.clone(),
            function,
            stablehlo,
            executable,
        })
    }

    /// The simplified function that was compiled.
    pub fn function(&self) -> &Function {
        &self.function
    }

    /// The StableHLO text that was compiled.
    pub fn stablehlo(&self) -> &str {
        &self.stablehlo
    }

    pub fn executable(&self) -> &LoadedExecutable {
        &self.executable
    }

    fn check_inputs(&self, types: &[TensorType]) -> Result<()> {
        check_signature(&self.function, types.iter())
    }

    /// Runs on device buffers (all on the executable's device); outputs stay
    /// on the device.
    pub(crate) fn run_buffers(&self, inputs: &[&Buffer]) -> Result<Vec<Buffer>> {
        let types = inputs
            .iter()
            .map(|b| Ok(TensorType::new(b.dtype()?, b.dims()?)))
            .collect::<Result<Vec<_>>>()?;
        self.check_inputs(&types)?;
        let mut out = self.executable.execute(&[inputs.to_vec()])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Copies `inputs` to the device, runs, and copies the outputs back.
    pub fn run(&self, inputs: &[HostArray]) -> Result<Vec<HostArray>> {
        let types: Vec<TensorType> = inputs.iter().map(HostArray::ty).collect();
        self.check_inputs(&types)?;
        let device = &self.executable.devices()[0];
        let buffers = inputs
            .iter()
            .map(|h| self.client.buffer_from_host(h, device))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Buffer> = buffers.iter().collect();
        self.run_buffers(&refs)?
            .iter()
            .map(Buffer::to_host)
            .collect()
    }
}

/// A Rust function traced and compiled per input signature, like `jax.jit`.
pub struct Jit<F> {
    client: Client,
    name: String,
    input_names: Vec<String>,
    f: F,
    compiled: Mutex<HashMap<Vec<TensorType>, Arc<CompiledFunction>>>,
}

impl<F, O> Jit<F>
where
    F: Fn(&Inputs) -> O,
    O: Into<Outputs>,
{
    /// `f` over inputs named `input_names`.
    pub fn new(client: &Client, name: &str, input_names: &[&str], f: F) -> Self {
        Jit {
            client: client.clone(),
            name: name.to_string(),
            input_names: input_names.iter().map(|s| s.to_string()).collect(),
            f,
            compiled: Mutex::new(HashMap::new()),
        }
    }

    /// The compiled function for inputs of `types` (traced on first use).
    pub fn compile(&self, types: &[TensorType]) -> Result<Arc<CompiledFunction>> {
        if types.len() != self.input_names.len() {
            return Err(Error::InvalidArgument(format!(
                "{} takes {} inputs, {} were given",
                self.name,
                self.input_names.len(),
                types.len()
            )));
        }
        if let Some(c) = self
            .compiled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(types)
        {
            return Ok(c.clone());
        }
        let inputs: Vec<(&str, TensorType)> = self
            .input_names
            .iter()
            .map(String::as_str)
            .zip(types.iter().cloned())
            .collect();
        let function = hlo_ir::trace(&self.name, &inputs, &self.f)
            .map_err(|e| Error::InvalidArgument(format!("tracing {}: {e}", self.name)))?;
        let compiled = Arc::new(CompiledFunction::new(&self.client, &function)?);
        self.compiled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(types.to_vec(), compiled.clone());
        Ok(compiled)
    }

    /// Traces and compiles for these inputs' types if needed, then runs.
    pub fn call(&self, inputs: &[HostArray]) -> Result<Vec<HostArray>> {
        let types: Vec<TensorType> = inputs.iter().map(HostArray::ty).collect();
        self.compile(&types)?.run(inputs)
    }
}
