//! The aggregates of the AggGrpSort bundle as exact integer arithmetic:
//! sums and counts of integer and decimal expressions, per group.
//!
//! Q1's bundle (section 4.2 of the smart-storage paper) sums four decimal
//! expressions, `l_extendedprice * (1 - l_discount) * (1 + l_tax)` the
//! largest, over every row of a node. DataFusion evaluates them in
//! Decimal128 with overflow checks on every operation, then hash-updates
//! each sum: at scale factor 10 (15 million rows a node) most of the
//! bundle's time. A decimal is an integer with a scale, so the same sums
//! are integer arithmetic: each expression is compiled once to a tree of
//! column reads, literals, additions, subtractions and products with the
//! scale of every node (an addition aligns its operands to the larger
//! scale, a product adds the scales, as SQL and DataFusion do), evaluated a
//! row block at a time in 64-bit integers with every operation checked,
//! and summed into 128-bit accumulators per group. A block whose values
//! overflow 64 bits is evaluated again in checked 128-bit arithmetic.
//!
//! [`aggregate`] declines (returns `None`, and the caller lets DataFusion
//! aggregate) for anything else: a function other than `Sum` or `Count`, a
//! column with nulls or of another type, a result type or scale other than
//! the one DataFusion plans (so the answer is always DataFusion's, bit for
//! bit), or a sum past its result's precision.

use arrow::array::{Array, ArrayRef, AsArray, Decimal128Array, Int64Array, RecordBatch};
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Decimal32Type, Decimal64Type, Decimal128Type, FieldRef, Int8Type,
    Int16Type, Int32Type, Int64Type, SchemaRef,
};
use std::sync::Arc;

use crate::error::Result;
use crate::plan::{AggFunc, Aggregate, Value};

/// A compiled expression: what each node reads or computes, and its scale.
#[derive(Debug, Clone)]
enum Node {
    /// Column `index` of the batches.
    Column {
        index: usize,
    },
    /// A literal's unscaled value.
    Literal(i128),
    Add(Box<Scaled>, Box<Scaled>),
    Sub(Box<Scaled>, Box<Scaled>),
    Mul(Box<Scaled>, Box<Scaled>),
}

/// A node and the decimal scale of its values.
#[derive(Debug, Clone)]
struct Scaled {
    node: Node,
    scale: u32,
}

/// Most decimal digits a scale may reach (Decimal128's precision).
const MAX_SCALE: u32 = 38;

/// Compiles `v` against `schema`; `None` when it is not exact integer or
/// decimal arithmetic over non-negative scales.
fn compile(v: &Value, schema: &SchemaRef) -> Option<Scaled> {
    Some(match v {
        Value::Column(name) => {
            let index = schema.index_of(name).ok()?;
            let scale = match schema.field(index).data_type() {
                DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => 0,
                DataType::Decimal32(_, s)
                | DataType::Decimal64(_, s)
                | DataType::Decimal128(_, s)
                    if *s >= 0 =>
                {
                    *s as u32
                }
                _ => return None,
            };
            Scaled {
                node: Node::Column { index },
                scale,
            }
        }
        Value::Int(i) => Scaled {
            node: Node::Literal(*i as i128),
            scale: 0,
        },
        Value::Decimal(s) => {
            let (neg, digits) = match s.strip_prefix('-') {
                Some(rest) => (true, rest),
                None => (false, s.as_str()),
            };
            let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
            if int.is_empty()
                || !int.bytes().all(|b| b.is_ascii_digit())
                || !frac.bytes().all(|b| b.is_ascii_digit())
                || int.len() + frac.len() > 38
            {
                return None;
            }
            let v: i128 = format!("{int}{frac}").parse().ok()?;
            Scaled {
                node: Node::Literal(if neg { -v } else { v }),
                scale: frac.len() as u32,
            }
        }
        Value::Add(a, b) | Value::Sub(a, b) => {
            let (a, b) = (compile(a, schema)?, compile(b, schema)?);
            let scale = a.scale.max(b.scale);
            let (a, b) = (Box::new(rescale(a, scale)?), Box::new(rescale(b, scale)?));
            Scaled {
                node: if matches!(v, Value::Add(..)) {
                    Node::Add(a, b)
                } else {
                    Node::Sub(a, b)
                },
                scale,
            }
        }
        Value::Mul(a, b) => {
            let (a, b) = (compile(a, schema)?, compile(b, schema)?);
            let scale = a.scale + b.scale;
            if scale > MAX_SCALE {
                return None;
            }
            Scaled {
                node: Node::Mul(Box::new(a), Box::new(b)),
                scale,
            }
        }
        Value::Date(_) | Value::Str(_) => return None,
    })
}

/// `x` at the larger scale `to`: multiplied by a literal power of ten.
fn rescale(x: Scaled, to: u32) -> Option<Scaled> {
    if x.scale == to {
        return Some(x);
    }
    let factor = 10i128.checked_pow(to - x.scale)?;
    Some(Scaled {
        node: Node::Mul(
            Box::new(x),
            Box::new(Scaled {
                node: Node::Literal(factor),
                scale: 0,
            }),
        ),
        scale: to,
    })
}

/// A node's values over one row block in 64 bits: a column's own
/// buffer, computed values, or one value for every row (a literal).
enum Vals<'a> {
    Borrowed(&'a [i64]),
    Owned(Vec<i64>),
    Scalar(i64),
}

impl Vals<'_> {
    fn get(&self, i: usize) -> i64 {
        match self {
            Vals::Borrowed(v) => v[i],
            Vals::Owned(v) => v[i],
            Vals::Scalar(v) => *v,
        }
    }
}

/// A narrower column's values, widened to `i64`.
fn widen<T: ArrowPrimitiveType>(a: &ArrayRef) -> Vals<'static>
where
    T::Native: Into<i64>,
{
    Vals::Owned(
        a.as_primitive::<T>()
            .values()
            .iter()
            .map(|&v| v.into())
            .collect(),
    )
}

/// A column's values as `i64` (its own buffer when it is 64-bit); `None`
/// past 64 bits or with nulls.
fn column_i64(a: &ArrayRef) -> Option<Vals<'_>> {
    if a.null_count() > 0 {
        return None;
    }
    match a.data_type() {
        DataType::Int8 => Some(widen::<Int8Type>(a)),
        DataType::Int16 => Some(widen::<Int16Type>(a)),
        DataType::Int32 => Some(widen::<Int32Type>(a)),
        DataType::Int64 => Some(Vals::Borrowed(a.as_primitive::<Int64Type>().values())),
        DataType::Decimal32(..) => Some(widen::<Decimal32Type>(a)),
        DataType::Decimal64(..) => Some(Vals::Borrowed(a.as_primitive::<Decimal64Type>().values())),
        DataType::Decimal128(..) => a
            .as_primitive::<Decimal128Type>()
            .values()
            .iter()
            .map(|&v| i64::try_from(v).ok())
            .collect::<Option<Vec<_>>>()
            .map(Vals::Owned),
        _ => None,
    }
}

/// A column's values as `i128`; `None` with nulls.
fn column_i128(a: &ArrayRef) -> Option<Vec<i128>> {
    if let DataType::Decimal128(..) = a.data_type() {
        if a.null_count() > 0 {
            return None;
        }
        return Some(a.as_primitive::<Decimal128Type>().values().to_vec());
    }
    let v = column_i64(a)?;
    Some((0..a.len()).map(|i| i128::from(v.get(i))).collect())
}

/// `op` over every row of `l` and `r` (`n` rows); `None` when any
/// overflows. Generic over `op` so each operation's loop is compiled with
/// it inlined; overflow is collected, not branched on, per row.
fn combine(
    l: &Vals,
    r: &Vals,
    n: usize,
    op: impl Fn(i64, i64) -> (i64, bool),
) -> Option<Vals<'static>> {
    let mut overflow = false;
    let mut out = Vec::with_capacity(n);
    let mut push = |(v, o): (i64, bool)| {
        overflow |= o;
        out.push(v);
    };
    match (l, r) {
        (Vals::Scalar(a), Vals::Scalar(b)) => {
            let (v, o) = op(*a, *b);
            return (!o).then_some(Vals::Scalar(v));
        }
        (Vals::Scalar(a), r) => {
            let r = slice(r);
            r.iter().for_each(|&b| push(op(*a, b)));
        }
        (l, Vals::Scalar(b)) => {
            let l = slice(l);
            l.iter().for_each(|&a| push(op(a, *b)));
        }
        (l, r) => {
            let (l, r) = (slice(l), slice(r));
            l.iter().zip(r).for_each(|(&a, &b)| push(op(a, b)));
        }
    }
    (!overflow).then_some(Vals::Owned(out))
}

fn slice<'a>(v: &'a Vals) -> &'a [i64] {
    match v {
        Vals::Borrowed(v) => v,
        Vals::Owned(v) => v,
        Vals::Scalar(_) => unreachable!("scalars are handled by the caller"),
    }
}

/// Evaluates `x` over `batch` in 64-bit arithmetic, every operation
/// checked; `None` on overflow (or a column past 64 bits).
fn eval_i64<'a>(x: &Scaled, batch: &'a RecordBatch) -> Option<Vals<'a>> {
    let n = batch.num_rows();
    match &x.node {
        Node::Column { index } => column_i64(batch.column(*index)),
        Node::Literal(v) => Some(Vals::Scalar(i64::try_from(*v).ok()?)),
        Node::Add(a, b) => combine(
            &eval_i64(a, batch)?,
            &eval_i64(b, batch)?,
            n,
            i64::overflowing_add,
        ),
        Node::Sub(a, b) => combine(
            &eval_i64(a, batch)?,
            &eval_i64(b, batch)?,
            n,
            i64::overflowing_sub,
        ),
        Node::Mul(a, b) => combine(
            &eval_i64(a, batch)?,
            &eval_i64(b, batch)?,
            n,
            i64::overflowing_mul,
        ),
    }
}

/// The runs of equal group ids in a row block: (group, first row, end).
/// The Sort leaves whole batches in one group, so this is one run or two.
/// `None` when there are more than `at_most` (rows not clustered by group:
/// an aggregation reading a deferred Sort's input unsorted).
fn runs(ids: &[u32], at_most: usize) -> Option<Vec<(usize, usize, usize)>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < ids.len() {
        if out.len() == at_most {
            return None;
        }
        let g = ids[at];
        let end = ids[at..]
            .iter()
            .position(|&x| x != g)
            .map_or(ids.len(), |p| at + p);
        out.push((g as usize, at, end));
        at = end;
    }
    Some(out)
}

/// Up to this many groups, [`add_rows`] makes a vectorized pass per group.
const MASKED_GROUPS: usize = 8;

/// Adds `values` of rows with group ids `ids` into `sums`, row by row: in
/// 64-bit partial sums per group when they cannot overflow
/// ([`sums_fit_i64`]), else in 128 bits.
fn add_rows(ids: &[u32], values: &Vals, sums: &mut [i128]) {
    let values = match values {
        Vals::Scalar(v) => {
            let mut n = vec![0i64; sums.len()];
            if sums.len() <= MASKED_GROUPS {
                for (g, n) in n.iter_mut().enumerate() {
                    *n = ids.iter().filter(|&&i| i == g as u32).count() as i64;
                }
            } else {
                for &g in ids {
                    n[g as usize] += 1;
                }
            }
            for (s, n) in sums.iter_mut().zip(n) {
                *s += i128::from(*v) * i128::from(n);
            }
            return;
        }
        v => slice(v),
    };
    if sums_fit_i64(values) {
        if sums.len() <= MASKED_GROUPS {
            // A pass per group, adding the values whose id is the group's:
            // a loop the compiler vectorizes, where a scatter would wait
            // on the last store to the same group's sum.
            for (g, s) in sums.iter_mut().enumerate() {
                let g = g as u32;
                *s += i128::from(ids.iter().zip(values).fold(0i64, |a, (&i, &x)| {
                    a.wrapping_add(if i == g { x } else { 0 })
                }));
            }
            return;
        }
        let mut partial = vec![0i64; sums.len()];
        for (&g, &x) in ids.iter().zip(values) {
            partial[g as usize] += x;
        }
        for (s, p) in sums.iter_mut().zip(partial) {
            *s += i128::from(p);
        }
    } else {
        for (&g, &x) in ids.iter().zip(values) {
            sums[g as usize] += i128::from(x);
        }
    }
}

/// Whether any sum of values of `v` fits 64 bits: every value lies in
/// `[-b, b)` for a power of two `b` with `b * len <= 2^62`. Tested as
/// `x + b < 2b` on the values' bits, ORed together: adds and ORs a loop
/// the compiler vectorizes (the largest magnitude is a 64-bit unsigned
/// maximum, which SSE2 has no instruction for).
fn sums_fit_i64(v: &[i64]) -> bool {
    let Some(bits) = 62u32.checked_sub(v.len().next_power_of_two().trailing_zeros()) else {
        return false;
    };
    let b = 1u64 << bits;
    v.iter().fold(0u64, |a, &x| a | (x as u64).wrapping_add(b)) < 2 * b
}

/// The exact sum of `v`: in 64 bits (a loop the compiler vectorizes) when
/// no sum of its values can overflow them ([`sums_fit_i64`]), else in 128.
fn sum_exact(v: &[i64]) -> i128 {
    if sums_fit_i64(v) {
        v.iter().fold(0i64, |a, &x| a.wrapping_add(x)) as i128
    } else {
        v.iter().map(|&x| i128::from(x)).sum()
    }
}

/// Adds `values` (of the rows of `runs`) into `sums`, a run at a time.
fn add_runs(runs: &[(usize, usize, usize)], values: &Vals, sums: &mut [i128]) {
    for &(g, start, end) in runs {
        sums[g] += match values {
            Vals::Scalar(v) => i128::from(*v) * (end - start) as i128,
            v => sum_exact(&slice(v)[start..end]),
        };
    }
}

/// [`eval_i64`] in checked 128-bit arithmetic.
fn eval_i128(x: &Scaled, batch: &RecordBatch) -> Option<Vec<i128>> {
    let n = batch.num_rows();
    match &x.node {
        Node::Column { index } => column_i128(batch.column(*index)),
        Node::Literal(v) => Some(vec![*v; n]),
        Node::Add(a, b) => zip_checked(
            eval_i128(a, batch)?,
            eval_i128(b, batch)?,
            i128::checked_add,
        ),
        Node::Sub(a, b) => zip_checked(
            eval_i128(a, batch)?,
            eval_i128(b, batch)?,
            i128::checked_sub,
        ),
        Node::Mul(a, b) => zip_checked(
            eval_i128(a, batch)?,
            eval_i128(b, batch)?,
            i128::checked_mul,
        ),
    }
}

/// `op` over `l` and `r` row by row; `None` when any overflows.
fn zip_checked(
    l: Vec<i128>,
    r: Vec<i128>,
    op: impl Fn(i128, i128) -> Option<i128>,
) -> Option<Vec<i128>> {
    l.into_iter().zip(r).map(|(l, r)| op(l, r)).collect()
}

/// The columns `x` reads.
fn columns_of(x: &Scaled, out: &mut Vec<usize>) {
    match &x.node {
        Node::Column { index } => out.push(*index),
        Node::Literal(_) => {}
        Node::Add(a, b) | Node::Sub(a, b) | Node::Mul(a, b) => {
            columns_of(a, out);
            columns_of(b, out);
        }
    }
}

/// One output column's plan.
enum Plan {
    Count,
    Sum(Scaled),
}

/// Each aggregate's plan; `None` when one is not exact arithmetic of the
/// type DataFusion plans (see the module docs).
fn plan(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    aggregates: &[Aggregate],
    want: &[FieldRef],
) -> Option<Vec<Plan>> {
    if aggregates.len() != want.len() {
        return None;
    }
    let mut plans = Vec::with_capacity(aggregates.len());
    for (a, field) in aggregates.iter().zip(want) {
        let arg = compile(&a.arg, schema)?;
        let plan = match (a.func, field.data_type()) {
            (AggFunc::Count, DataType::Int64) => {
                // Counts its non-null arguments: every row, when the
                // columns it reads have no nulls.
                let mut columns = Vec::new();
                columns_of(&arg, &mut columns);
                if batches
                    .iter()
                    .any(|b| columns.iter().any(|&c| b.column(c).null_count() > 0))
                {
                    return None;
                }
                Plan::Count
            }
            (
                AggFunc::Sum,
                DataType::Decimal32(_, s) | DataType::Decimal64(_, s) | DataType::Decimal128(_, s),
            ) if *s >= 0 && *s as u32 == arg.scale => Plan::Sum(arg),
            (AggFunc::Sum, DataType::Int64) if arg.scale == 0 => Plan::Sum(arg),
            _ => return None,
        };
        plans.push(plan);
    }
    Some(plans)
}

/// The output columns from the per-group sums and counts; `None` when a
/// sum is past its type's range.
fn finish(
    plans: &[Plan],
    sums: Vec<Vec<i128>>,
    counts: &[i128],
    want: &[FieldRef],
) -> Result<Option<Vec<ArrayRef>>> {
    let mut out: Vec<ArrayRef> = Vec::with_capacity(plans.len());
    for ((plan, sum), field) in plans.iter().zip(sums).zip(want) {
        out.push(match (plan, field.data_type()) {
            (Plan::Count, _) => Arc::new(Int64Array::from_iter_values(
                counts.iter().map(|&c| c as i64),
            )),
            (
                Plan::Sum(_),
                DataType::Decimal32(p, s) | DataType::Decimal64(p, s) | DataType::Decimal128(p, s),
            ) => {
                // A sum past its type's precision is DataFusion's to report.
                let bound = 10i128.checked_pow(u32::from(*p));
                if bound.is_none_or(|b| sum.iter().any(|v| v.abs() >= b)) {
                    return Ok(None);
                }
                let wide: ArrayRef =
                    Arc::new(Decimal128Array::from(sum).with_precision_and_scale(38, *s)?);
                arrow::compute::cast(&wide, field.data_type())?
            }
            (Plan::Sum(_), _) => {
                let Some(v) = sum
                    .iter()
                    .map(|&v| i64::try_from(v).ok())
                    .collect::<Option<Vec<_>>>()
                else {
                    return Ok(None);
                };
                Arc::new(Int64Array::from(v))
            }
        });
    }
    Ok(Some(out))
}

/// Per-group `aggregates` over `batches`, whose rows carry group ids `ids`
/// (one `UInt32` column per batch, ids `0 .. groups`), as columns of the
/// types `want` gives (DataFusion's plan of the same aggregates, in
/// order); `None` when this path declines (see the module docs).
pub fn aggregate(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    ids: &[ArrayRef],
    groups: usize,
    aggregates: &[Aggregate],
    want: &[FieldRef],
) -> Result<Option<Vec<ArrayRef>>> {
    let Some(plans) = plan(schema, batches, aggregates, want) else {
        return Ok(None);
    };
    let mut sums = vec![vec![0i128; groups]; plans.len()];
    let mut counts = vec![0i128; groups];
    for (batch, ids) in batches.iter().zip(ids) {
        let ids = ids.as_primitive::<arrow::datatypes::UInt32Type>().values();
        // Runs as short as unclustered input's are added row by row.
        let runs = runs(ids, ids.len() / crate::rungroup::MIN_MEAN_RUN);
        let add = |values: &Vals, sums: &mut [i128]| match &runs {
            Some(runs) => add_runs(runs, values, sums),
            None => add_rows(ids, values, sums),
        };
        add(&Vals::Scalar(1), &mut counts);
        for (plan, sum) in plans.iter().zip(sums.iter_mut()) {
            let Plan::Sum(arg) = plan else { continue };
            if let Some(values) = eval_i64(arg, batch) {
                // At most 2^32 rows of values below 2^63: no overflow.
                add(&values, sum);
                continue;
            }
            let Some(values) = eval_i128(arg, batch) else {
                return Ok(None);
            };
            for (&g, &v) in ids.iter().zip(&values) {
                let Some(s) = sum[g as usize].checked_add(v) else {
                    return Ok(None);
                };
                sum[g as usize] = s;
            }
        }
    }
    finish(&plans, sums, &counts, want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Decimal64Array, StringArray, UInt32Array};
    use arrow::datatypes::{Field, Schema};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("price", DataType::Decimal64(15, 2), true),
            Field::new("big", DataType::Decimal128(38, 0), false),
            Field::new("name", DataType::Utf8, false),
        ]))
    }

    fn batch(prices: Vec<Option<i64>>, big: Vec<i128>) -> RecordBatch {
        let n = prices.len();
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(
                    Decimal64Array::from(prices)
                        .with_precision_and_scale(15, 2)
                        .unwrap(),
                ),
                Arc::new(
                    Decimal128Array::from(big)
                        .with_precision_and_scale(38, 0)
                        .unwrap(),
                ),
                Arc::new(StringArray::from_iter_values((0..n).map(|i| i.to_string()))),
            ],
        )
        .unwrap()
    }

    fn sum(arg: Value) -> Aggregate {
        Aggregate {
            func: AggFunc::Sum,
            arg,
            name: "s".into(),
        }
    }

    fn field(t: DataType) -> FieldRef {
        Arc::new(Field::new("s", t, true))
    }

    #[test]
    fn products_and_differences_sum_exactly_per_group_at_the_planned_scale() {
        // (1.00 - price) * price at scale 4, groups 0, 1, 0.
        let b = batch(vec![Some(150), Some(-25), Some(1)], vec![0, 0, 0]);
        let ids: ArrayRef = Arc::new(UInt32Array::from(vec![0, 1, 0]));
        let arg = Value::times(
            Value::minus(Value::Decimal("1.00".into()), Value::col("price")),
            Value::col("price"),
        );
        let out = aggregate(
            &schema(),
            &[b],
            &[ids],
            2,
            &[sum(arg)],
            &[field(DataType::Decimal128(38, 4))],
        )
        .unwrap()
        .expect("exact arithmetic");
        let got = out[0].as_primitive::<Decimal128Type>();
        // Group 0: (100-150)*150 + (100-1)*1 = -7401; group 1: 125*-25.
        assert_eq!(got.values().to_vec(), vec![-7401, -3125]);
    }

    #[test]
    fn rows_not_clustered_by_group_sum_and_count_exactly_row_by_row() {
        // Groups alternating every row (no runs), values small enough for
        // 64-bit partial sums, and then large enough that only 128 bits
        // hold their sum.
        // Few groups (a pass per group) and many (a scatter).
        let n = 1000usize;
        for (groups, scale) in [
            (3usize, 1i64),
            (3, i64::MAX / 600),
            (12, 1),
            (12, i64::MAX / 600),
        ] {
            let ids_of: Vec<u32> = (0..n).map(|i| ((i * 7) % groups) as u32).collect();
            let prices: Vec<i64> = (0..n as i64).map(|i| (i - 400) * scale).collect();
            let b = batch(prices.iter().copied().map(Some).collect(), vec![0; n]);
            let ids: ArrayRef = Arc::new(UInt32Array::from(ids_of.clone()));
            let count = Aggregate {
                func: AggFunc::Count,
                arg: Value::col("price"),
                name: "c".into(),
            };
            let out = aggregate(
                &schema(),
                &[b],
                &[ids],
                groups,
                &[sum(Value::col("price")), count],
                &[field(DataType::Decimal128(38, 2)), field(DataType::Int64)],
            )
            .unwrap()
            .expect("exact arithmetic");
            let mut want = vec![0i128; groups];
            let mut counts = vec![0i64; groups];
            for (&g, &p) in ids_of.iter().zip(&prices) {
                want[g as usize] += i128::from(p);
                counts[g as usize] += 1;
            }
            assert_eq!(
                out[0].as_primitive::<Decimal128Type>().values().to_vec(),
                want
            );
            assert_eq!(
                out[1]
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec(),
                counts
            );
        }
    }

    #[test]
    fn the_64_bit_test_admits_only_values_whose_sums_fit() {
        assert!(sums_fit_i64(&[]));
        // One value: within 2^62.
        assert!(sums_fit_i64(&[i64::MAX / 2]));
        assert!(sums_fit_i64(&[-(1 << 62)]));
        assert!(!sums_fit_i64(&[1 << 62]));
        // Two: within 2^61.
        assert!(!sums_fit_i64(&[i64::MAX / 2, 0]));
        assert!(sums_fit_i64(&[(1 << 61) - 1, -(1 << 61)]));
        // 1024 values: each within 2^52.
        let mut v = vec![(1i64 << 52) - 1; 1024];
        assert!(sums_fit_i64(&v));
        assert!(v.iter().map(|&x| i128::from(x)).sum::<i128>() < i128::from(i64::MAX));
        v[7] = 1 << 52;
        assert!(!sums_fit_i64(&v));
        v[7] = -(1 << 52);
        assert!(sums_fit_i64(&v));
        v[7] = -(1 << 52) - 1;
        assert!(!sums_fit_i64(&v));
        assert!(!sums_fit_i64(&[i64::MIN]));
    }

    #[test]
    fn values_past_64_bits_are_summed_in_128() {
        let big = i64::MAX as i128 * 4;
        let b = batch(vec![Some(1), Some(2)], vec![big, -big / 2]);
        let ids: ArrayRef = Arc::new(UInt32Array::from(vec![0, 0]));
        let out = aggregate(
            &schema(),
            &[b],
            &[ids],
            1,
            &[sum(Value::col("big"))],
            &[field(DataType::Decimal128(38, 0))],
        )
        .unwrap()
        .expect("128-bit path");
        assert_eq!(
            out[0].as_primitive::<Decimal128Type>().value(0),
            big - big / 2
        );
    }

    #[test]
    fn what_is_not_exact_arithmetic_over_non_null_columns_is_declined() {
        let ids: ArrayRef = Arc::new(UInt32Array::from(vec![0, 0]));
        let b = batch(vec![Some(1), None], vec![1, 2]);
        let decimal = field(DataType::Decimal64(18, 2));
        let cases: Vec<(Aggregate, FieldRef)> = vec![
            // A null in the column.
            (sum(Value::col("price")), decimal.clone()),
            // A string column.
            (sum(Value::col("name")), decimal.clone()),
            // A scale other than the one planned.
            (sum(Value::col("big")), decimal.clone()),
            // A function other than Sum or Count.
            (
                Aggregate {
                    func: AggFunc::Avg,
                    arg: Value::col("big"),
                    name: "a".into(),
                },
                field(DataType::Decimal128(38, 4)),
            ),
        ];
        for (agg, want) in cases {
            let got = aggregate(
                &schema(),
                std::slice::from_ref(&b),
                std::slice::from_ref(&ids),
                1,
                std::slice::from_ref(&agg),
                &[want],
            )
            .unwrap();
            assert!(got.is_none(), "{agg:?} was not declined");
        }
    }
}
