//! The parameter types of a program's `@main`, read from its MLIR text.
//!
//! The plugin checks an argument's byte size but not its element type or
//! dimensions (an `i32[2]` passes for an `f32[2]`, an `f32[3,2]` for an
//! `f32[2,3]`), so we keep the declared types and check arguments ourselves.

use hlo_ir::DType;

/// The declared type of one parameter (global shape for SPMD programs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamType {
    pub dtype: DType,
    pub dims: Vec<i64>,
}

/// Parameter types of `@main`, or `None` where a parameter's type is not a
/// static tensor we understand (the check is skipped for those).
pub fn main_parameters(mlir: &str) -> Option<Vec<Option<ParamType>>> {
    let start = mlir.find("@main(")? + "@main(".len();
    let mut depth = 0i32;
    let mut params = Vec::new();
    let mut current = String::new();
    for c in mlir[start..].chars() {
        match c {
            '(' | '<' | '{' | '[' => depth += 1,
            ')' if depth == 0 => {
                if !current.trim().is_empty() {
                    params.push(parse_param(&current));
                }
                return Some(params);
            }
            ')' | '>' | '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                params.push(parse_param(&current));
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    None
}

/// `%name: tensor<2x3xf32> {attrs}` → `f32[2,3]`.
fn parse_param(text: &str) -> Option<ParamType> {
    let ty = text.split_once(':')?.1.trim();
    let inner = ty.strip_prefix("tensor<")?;
    let inner = &inner[..inner.find('>')?];
    // An encoding (`tensor<2xf32, #enc>`) is not ours to interpret.
    if inner.contains(',') {
        return None;
    }
    let mut parts: Vec<&str> = inner.split('x').collect();
    let dtype = parts.pop()?.trim().parse::<DType>().ok()?;
    let dims = parts
        .iter()
        .map(|d| d.trim().parse::<i64>().ok())
        .collect::<Option<Vec<_>>>()?;
    Some(ParamType { dtype, dims })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_main_parameters() {
        let text = r#"module @m {
  sdy.mesh @mesh = <["x"=2]>
  func.func private @helper(%q: tensor<9xf64>) -> tensor<9xf64>
  func.func public @main(%arg0: tensor<2x3xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>},
                         %b: tensor<bf16>, %c: tensor<4x?xi32>, %d: tensor<7xui8>, %e: tensor<1xi1>)
      -> (tensor<2x3xf32>) {"#;
        let params = main_parameters(text).unwrap();
        assert_eq!(
            params,
            vec![
                Some(ParamType {
                    dtype: DType::F32,
                    dims: vec![2, 3]
                }),
                Some(ParamType {
                    dtype: DType::BF16,
                    dims: vec![]
                }),
                None,
                Some(ParamType {
                    dtype: DType::U8,
                    dims: vec![7]
                }),
                Some(ParamType {
                    dtype: DType::Pred,
                    dims: vec![1]
                }),
            ]
        );
        assert_eq!(
            main_parameters("func.func public @main() -> () {"),
            Some(vec![])
        );
        assert_eq!(main_parameters("func.func @other(%a: tensor<f32>)"), None);
    }
}
