//! Plan fragments: what the host sends a storage node to run.
//!
//! Section 2.3 of the smart-storage paper: the host parses and optimises the
//! query, then "the optimized query or code is then distributed to the SNs
//! of the involved SSGs, and execution commences". A fragment names one
//! primitive (Scan, Sort, or the operations bundle AggGrpSort, which runs
//! Group-by + Aggregate + LocalSort as one node), the stored object it
//! reads and the object it materialises, so the output can be checkpointed
//! and the query resumed from it (section 4.2).
//!
//! ## Wire format
//!
//! A fragment travels as JSON in the body of the Flight action `run`:
//!
//! ```json
//! {"input":"lineitem","output":"q1.scan",
//!  "primitive":{"op":"scan",
//!    "filter":[{"left":{"column":"l_shipdate"},"cmp":"le","right":{"date":"1998-09-02"}}],
//!    "columns":["l_returnflag","l_linestatus","l_quantity"]}}
//! ```
//!
//! Optional fields: `"also"` (more objects of the same columns, read as
//! one input with `input`), `"materialize"` (default `true`: write the
//! output to the device as a table object; the host sends `false` and
//! lets a checkpoint write it) and `"defer"` (default `false`: whether the
//! node may defer the primitive into whatever reads its output, see
//! `node::bounded`; the host sends `true` for queries without
//! checkpoints).
//!
//! Unknown fields, unknown operators and unknown columns are refused with
//! an error naming them; a node never guesses.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One primitive over one stored object, materialised as another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fragment {
    /// Object read.
    pub input: String,
    /// More objects read, with the same schema: the primitive runs over
    /// the union (a node holding several redistributed pieces).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<String>,
    /// Object written.
    pub output: String,
    /// What to run.
    pub primitive: Primitive,
    /// Write the output to the node's device (so it can be checkpointed
    /// and survive the node's memory); otherwise keep it in memory only.
    #[serde(default = "yes")]
    pub materialize: bool,
    /// Whether the node may defer the primitive into whatever reads its
    /// output (a Sort; a Scan that would stream) when the output is not
    /// materialised (see `node::bounded`). The host allows it only for a
    /// query without checkpoints: a checkpoint needs each primitive's
    /// output, and running a deferred one for it would read its input a
    /// second time beside the next primitive.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub defer: bool,
}

fn yes() -> bool {
    true
}

/// The paper's primitives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Primitive {
    /// Select rows (all predicates hold) and optionally project columns.
    Scan {
        /// Conjunction of comparisons.
        filter: Vec<Predicate>,
        /// Columns kept, in this order; all when absent.
        columns: Option<Vec<String>>,
    },
    /// Sort by keys.
    Sort {
        /// Sort keys, most significant first.
        keys: Vec<SortKey>,
    },
    /// The bundle Group-by + Aggregate + LocalSort: group, aggregate, sort by
    /// the group keys.
    AggGrpSort {
        /// Grouping columns (also the local sort keys).
        group_by: Vec<String>,
        /// Aggregates computed per group.
        aggregates: Vec<Aggregate>,
    },
}

/// A comparison `left cmp right`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicate {
    /// Left operand.
    pub left: Value,
    /// Comparison.
    pub cmp: Cmp,
    /// Right operand.
    pub right: Value,
}

/// Comparison operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cmp {
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `=`
    Eq,
    /// `>=`
    Ge,
    /// `>`
    Gt,
}

/// A scalar expression over a row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Value {
    /// A column by name.
    Column(String),
    /// A decimal literal such as `"1.00"`.
    Decimal(String),
    /// A date literal, `YYYY-MM-DD`.
    Date(String),
    /// An integer literal.
    Int(i64),
    /// A string literal.
    Str(String),
    /// Sum of two values.
    Add(Box<Value>, Box<Value>),
    /// Difference of two values.
    Sub(Box<Value>, Box<Value>),
    /// Product of two values.
    Mul(Box<Value>, Box<Value>),
}

/// Aggregate functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AggFunc {
    /// Sum.
    Sum,
    /// Row count.
    Count,
    /// Average.
    Avg,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
}

/// One aggregate output column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Aggregate {
    /// Function.
    pub func: AggFunc,
    /// Argument.
    pub arg: Value,
    /// Output column name.
    pub name: String,
}

/// A sort key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SortKey {
    /// Column.
    pub column: String,
    /// Descending instead of ascending.
    #[serde(default)]
    pub descending: bool,
}

impl SortKey {
    /// An ascending key.
    pub fn asc(column: &str) -> Self {
        SortKey {
            column: column.into(),
            descending: false,
        }
    }
}

impl Value {
    /// A column reference.
    pub fn col(name: &str) -> Self {
        Value::Column(name.into())
    }
    /// `a * b`
    pub fn times(a: Value, b: Value) -> Self {
        Value::Mul(Box::new(a), Box::new(b))
    }
    /// `a - b`
    pub fn minus(a: Value, b: Value) -> Self {
        Value::Sub(Box::new(a), Box::new(b))
    }
    /// `a + b`
    pub fn plus(a: Value, b: Value) -> Self {
        Value::Add(Box::new(a), Box::new(b))
    }
}

impl Primitive {
    /// The input columns the primitive reads, when it reads fewer than all
    /// (a Scan that projects); the node decodes only those.
    pub fn input_columns(&self) -> Option<Vec<String>> {
        match self {
            Primitive::Scan {
                filter,
                columns: Some(cols),
            } => {
                let mut need: Vec<String> = cols.clone();
                for p in filter {
                    for v in [&p.left, &p.right] {
                        v.columns(&mut need);
                    }
                }
                Some(need)
            }
            _ => None,
        }
    }
}

impl Value {
    /// Adds the columns this value reads to `out` (once each).
    pub fn columns(&self, out: &mut Vec<String>) {
        match self {
            Value::Column(c) if !out.contains(c) => out.push(c.clone()),
            Value::Add(a, b) | Value::Sub(a, b) | Value::Mul(a, b) => {
                a.columns(out);
                b.columns(out);
            }
            _ => {}
        }
    }
}

impl Fragment {
    /// Parses a fragment from its JSON wire form.
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        let f: Fragment =
            serde_json::from_slice(bytes).map_err(|e| Error::Plan(format!("malformed: {e}")))?;
        f.check()?;
        Ok(f)
    }

    /// The JSON wire form.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("fragments serialise")
    }

    /// Structural checks that need no data: object names are plain file
    /// names, lists that must not be empty are not.
    pub fn check(&self) -> Result<()> {
        check_object_name(&self.input)?;
        check_object_name(&self.output)?;
        for a in &self.also {
            check_object_name(a)?;
        }
        if self.input == self.output || self.also.contains(&self.output) {
            return Err(Error::Plan(format!(
                "output {:?} would overwrite its input",
                self.output
            )));
        }
        match &self.primitive {
            Primitive::Sort { keys } if keys.is_empty() => {
                Err(Error::Plan("sort without keys".into()))
            }
            Primitive::AggGrpSort { aggregates, .. } if aggregates.is_empty() => {
                Err(Error::Plan("agg_grp_sort without aggregates".into()))
            }
            Primitive::Scan {
                columns: Some(c), ..
            } if c.is_empty() => Err(Error::Plan("scan keeping no columns".into())),
            _ => Ok(()),
        }
    }
}

/// Object names are file names inside a node's directory: no path
/// separators, no leading dot, at most 200 bytes of `[A-Za-z0-9._-]`.
pub fn check_object_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::Plan(format!("bad object name {name:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_round_trip_through_json() {
        let f = Fragment {
            input: "lineitem".into(),
            output: "q1.scan".into(),
            primitive: Primitive::Scan {
                filter: vec![Predicate {
                    left: Value::col("l_shipdate"),
                    cmp: Cmp::Le,
                    right: Value::Date("1998-09-02".into()),
                }],
                columns: Some(vec!["l_quantity".into()]),
            },
            materialize: false,
            also: vec![],
            defer: false,
        };
        assert_eq!(Fragment::from_json(&f.to_json()).unwrap(), f);
        let deferred = Fragment {
            defer: true,
            ..f.clone()
        };
        assert_eq!(Fragment::from_json(&deferred.to_json()).unwrap(), deferred);
        // A fragment that does not say may not be deferred.
        let json = String::from_utf8(f.to_json().to_vec()).unwrap();
        assert!(!json.contains("defer"), "{json}");
        assert!(!Fragment::from_json(json.as_bytes()).unwrap().defer);
    }

    #[test]
    fn malformed_fragments_are_refused_naming_the_problem() {
        let cases: &[(&str, &str)] = &[
            ("{", "malformed"),
            (
                r#"{"input":"a","output":"b","primitive":{"op":"join"}}"#,
                "join",
            ),
            (
                r#"{"input":"a","output":"b","primitive":{"op":"sort","keys":[]}}"#,
                "without keys",
            ),
            (
                r#"{"input":"../etc/passwd","output":"b","primitive":{"op":"sort","keys":[{"column":"x"}]}}"#,
                "bad object name",
            ),
            (
                r#"{"input":"a","output":"a","primitive":{"op":"sort","keys":[{"column":"x"}]}}"#,
                "overwrite",
            ),
            (
                r#"{"input":"a","output":"b","primitive":{"op":"sort","keys":[{"column":"x"}]},"extra":1}"#,
                "extra",
            ),
        ];
        for (json, want) in cases {
            let e = Fragment::from_json(json.as_bytes())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
