//! Running the primitives with DataFusion on one node's data.
//!
//! Each storage node runs its fragment on its own partition (section 2.3 of
//! the smart-storage paper): the operators are DataFusion's, over an
//! in-memory table of the node's batches, with one target partition (one
//! embedded processor per node).

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::functions_aggregate::expr_fn as agg;
use datafusion::prelude::*;
use datafusion::scalar::ScalarValue;

use crate::error::{Error, Result};
use crate::plan::{AggFunc, Aggregate, Cmp, Primitive, Value};
use crate::{ranksort, rungroup};

pub mod bounded;
mod exactsum;
pub mod scanfilter;

/// Sorts whose input is smaller than this concatenate and sort once
/// instead of sorting each batch and merging. A node's input is in memory
/// already, so every sort is in place: DataFusion's estimate of an input's
/// size counts a shared buffer once per batch that slices it (batches
/// decoded zero-copy from one column segment), so any finite threshold
/// would send a stored object's sort down the merge path, ~3x slower.
pub const SORT_IN_PLACE_BYTES: usize = usize::MAX;

/// Rows per output batch of a primitive.
pub const BATCH_ROWS: usize = 16 * 1024;

/// A DataFusion context for one embedded processor.
pub fn context() -> SessionContext {
    SessionContext::new_with_config(config())
}

/// The session settings of one embedded processor.
fn config() -> SessionConfig {
    SessionConfig::new()
        .with_target_partitions(1)
        .with_batch_size(BATCH_ROWS)
        .set_usize(
            "datafusion.execution.sort_in_place_threshold_bytes",
            SORT_IN_PLACE_BYTES,
        )
}

/// A DataFrame over `batches` (which may be empty) with `schema`.
pub fn frame(
    ctx: &SessionContext,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<DataFrame> {
    let table = MemTable::try_new(schema, vec![batches])?;
    Ok(ctx.read_table(Arc::new(table))?)
}

/// Runs `primitive` over `batches`; returns the output's schema and batches.
pub async fn run(
    primitive: &Primitive,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    if let Primitive::Scan { .. } = primitive {
        return scan(primitive, &schema, batches);
    }
    if let Primitive::Sort { keys } = primitive {
        let by_index = keys
            .iter()
            .map(|k| {
                column(&k.column, &schema)?;
                Ok(ranksort::Key {
                    column: schema.index_of(&k.column)?,
                    descending: k.descending,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(sorted) = ranksort::sort(&schema, &batches, &by_index, BATCH_ROWS)? {
            return Ok((schema, sorted));
        }
    }
    if let Primitive::AggGrpSort {
        group_by,
        aggregates,
    } = primitive
        && let Some(out) = aggregate_by_runs(&schema, &batches, group_by, aggregates, None).await?
    {
        return Ok(out);
    }
    planned(primitive, schema, batches).await
}

/// `primitive` as DataFusion plans and runs it over `batches`: the path
/// of every primitive the kernels above do not take, and the reference
/// the tests hold those kernels to.
pub(crate) async fn planned(
    primitive: &Primitive,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let ctx = context();
    let df = apply(primitive, frame(&ctx, schema.clone(), batches)?, &schema)?;
    let out_schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
    let batches = df.collect().await?;
    Ok((out_schema, batches))
}

/// The Scan over batches held whole: each filtered and projected by
/// [`scanfilter::ScanFilter`] (no plan, no task, no copy of the rows kept
/// beyond the filter's), and the small pieces a selective filter leaves
/// gathered into blocks of up to [`BATCH_ROWS`] rows.
fn scan(
    primitive: &Primitive,
    schema: &SchemaRef,
    batches: Vec<RecordBatch>,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let filter = scanfilter::ScanFilter::new(primitive, schema)?;
    let out_schema = filter.schema().clone();
    let mut out = Vec::with_capacity(batches.len());
    let mut small: Vec<RecordBatch> = Vec::new();
    let mut small_rows = 0;
    for b in &batches {
        let kept = filter.apply(b)?;
        if kept.num_rows() >= BATCH_ROWS / 4 {
            out.push(kept);
            continue;
        }
        small_rows += kept.num_rows();
        small.push(kept);
        if small_rows >= BATCH_ROWS {
            out.push(arrow::compute::concat_batches(&out_schema, &small)?);
            small.clear();
            small_rows = 0;
        }
    }
    if small_rows > 0 {
        out.push(arrow::compute::concat_batches(&out_schema, &small)?);
    }
    Ok((out_schema, out))
}

/// A Scan's filter as one expression: the conjunction of its
/// comparisons; `None` when it has none.
fn predicate(filter: &[crate::plan::Predicate], schema: &SchemaRef) -> Result<Option<Expr>> {
    Ok(filter
        .iter()
        .map(|p| {
            let l = expr(&p.left, schema)?;
            let r = expr(&p.right, schema)?;
            Ok(match p.cmp {
                Cmp::Lt => l.lt(r),
                Cmp::Le => l.lt_eq(r),
                Cmp::Eq => l.eq(r),
                Cmp::Ge => l.gt_eq(r),
                Cmp::Gt => l.gt(r),
            })
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .reduce(Expr::and))
}

/// `primitive` as DataFusion plans it over `df` (whose columns are
/// `schema`'s).
fn apply(primitive: &Primitive, df: DataFrame, schema: &SchemaRef) -> Result<DataFrame> {
    Ok(match primitive {
        Primitive::Scan { filter, columns } => {
            let mut df = df;
            if let Some(pred) = predicate(filter, schema)? {
                df = df.filter(pred)?;
            }
            if let Some(cols) = columns {
                let exprs = cols
                    .iter()
                    .map(|c| column(c, schema))
                    .collect::<Result<Vec<_>>>()?;
                df = df.select(exprs)?;
            }
            df
        }
        Primitive::Sort { keys } => {
            let exprs = keys
                .iter()
                .map(|k| Ok(column(&k.column, schema)?.sort(!k.descending, false)))
                .collect::<Result<Vec<_>>>()?;
            df.sort(exprs)?
        }
        Primitive::AggGrpSort {
            group_by,
            aggregates,
        } => grouped(df, group_by, aggregates, schema)?,
    })
}

/// The AggGrpSort bundle as DataFusion plans it: aggregate `df` by the
/// columns `group_by`, then sort by them.
fn grouped(
    df: DataFrame,
    group_by: &[String],
    aggregates: &[Aggregate],
    schema: &SchemaRef,
) -> Result<DataFrame> {
    let groups = group_by
        .iter()
        .map(|c| column(c, schema))
        .collect::<Result<Vec<_>>>()?;
    let sort = group_by
        .iter()
        .map(|c| col(ident(c)).sort(true, false))
        .collect();
    Ok(df
        .aggregate(groups, aggregate_exprs(aggregates, schema)?)?
        .sort(sort)?)
}

fn aggregate_exprs(aggregates: &[Aggregate], schema: &SchemaRef) -> Result<Vec<Expr>> {
    aggregates
        .iter()
        .map(|a| {
            let arg = expr(&a.arg, schema)?;
            let e = match a.func {
                AggFunc::Sum => agg::sum(arg),
                AggFunc::Count => agg::count(arg),
                AggFunc::Avg => agg::avg(arg),
                AggFunc::Min => agg::min(arg),
                AggFunc::Max => agg::max(arg),
            };
            Ok(e.alias(&a.name))
        })
        .collect()
}

/// The schema of AggGrpSort's output over input `schema`: DataFusion's
/// plan of it over no rows (about a millisecond of planning).
pub(crate) fn agg_schema(
    schema: &SchemaRef,
    group_by: &[String],
    aggregates: &[Aggregate],
) -> Result<SchemaRef> {
    let ctx = context();
    Ok(Arc::new(
        grouped(
            frame(&ctx, schema.clone(), Vec::new())?,
            group_by,
            aggregates,
            schema,
        )?
        .schema()
        .as_arrow()
        .clone(),
    ))
}

/// AggGrpSort over `batches` whose output schema `want` was planned once
/// ([`agg_schema`]): the bounded aggregation runs it over one chunk of its
/// input after another, and planning each time cost more than
/// aggregating a chunk of Q1. Answers as [`run`] does.
pub(crate) async fn aggregate_planned(
    primitive: &Primitive,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    want: &SchemaRef,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    if let Primitive::AggGrpSort {
        group_by,
        aggregates,
    } = primitive
        && let Some(out) =
            aggregate_by_runs(&schema, &batches, group_by, aggregates, Some(want)).await?
    {
        return Ok(out);
    }
    run(primitive, schema, batches).await
}

/// The AggGrpSort bundle by dense group ids: over input clustered by its
/// group keys (Q1's Sort output) from the runs of equal keys, over
/// unclustered input with small dictionary keys (Q1's Scan output, read by
/// the bundle of a deferred Sort) from their codes ([`rungroup`]); lets
/// DataFusion aggregate
/// by the dense group id, then puts each group's key values back and sorts
/// the few result rows by them. The result equals [`grouped`]'s, schema
/// included. `None` when [`rungroup::group_ids`] declines.
async fn aggregate_by_runs(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    group_by: &[String],
    aggregates: &[Aggregate],
    want: Option<&SchemaRef>,
) -> Result<Option<(SchemaRef, Vec<RecordBatch>)>> {
    let keys = group_by
        .iter()
        .map(|c| {
            column(c, schema)?;
            Ok(schema.index_of(c)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let Some(groups) = rungroup::group_ids(batches, &keys)? else {
        return Ok(None);
    };
    let want = match want {
        Some(w) => w.clone(),
        None => agg_schema(schema, group_by, aggregates)?,
    };
    let mut columns = groups.keys.clone();
    if let Some(sums) = exactsum::aggregate(
        schema,
        batches,
        &groups.ids,
        groups.groups(),
        aggregates,
        &want.fields()[keys.len()..],
    )? {
        // Ids are dense and in key order of first appearance: the keys'
        // rows line up with the sums' rows.
        columns.extend(sums);
        return Ok(Some((
            want.clone(),
            vec![sort_groups(&want, columns, keys.len())?],
        )));
    }
    let mut id_name = String::from("__group");
    while schema.field_with_name(&id_name).is_ok() {
        id_name.push('_');
    }
    let mut fields = schema.fields().to_vec();
    fields.push(Arc::new(Field::new(&id_name, DataType::UInt32, false)));
    let with_ids = Arc::new(Schema::new(fields));
    let tagged = batches
        .iter()
        .zip(groups.ids.iter())
        .map(|(b, ids)| {
            let mut columns = b.columns().to_vec();
            columns.push(ids.clone());
            RecordBatch::try_new(with_ids.clone(), columns)
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let ctx = context();
    let per_id = frame(&ctx, with_ids, tagged)?
        .aggregate(
            vec![col(ident(&id_name))],
            aggregate_exprs(aggregates, schema)?,
        )?
        .collect()
        .await?;
    let Some(first) = per_id.first() else {
        return Ok(None); // no groups came back: let the hash path answer
    };
    let per_id = arrow::compute::concat_batches(&first.schema(), &per_id)?;
    let ids = per_id
        .column(0)
        .as_primitive::<arrow::datatypes::UInt32Type>();
    let mut columns = groups
        .keys
        .iter()
        .map(|k| arrow::compute::take(k, ids, None))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    columns.extend(per_id.columns()[1..].iter().cloned());
    Ok(Some((
        want.clone(),
        vec![sort_groups(&want, columns, keys.len())?],
    )))
}

/// One row per group (`columns`: the `keys` group-key columns first, then
/// the aggregates) sorted by the group keys, as the bundle's LocalSort.
fn sort_groups(want: &SchemaRef, columns: Vec<ArrayRef>, keys: usize) -> Result<RecordBatch> {
    let order = arrow::compute::lexsort_to_indices(
        &columns[..keys]
            .iter()
            .map(|c| arrow::compute::SortColumn {
                values: c.clone(),
                options: Some(arrow::compute::SortOptions {
                    descending: false,
                    nulls_first: false,
                }),
            })
            .collect::<Vec<_>>(),
        None,
    )?;
    let sorted = RecordBatch::try_new(want.clone(), columns)?;
    Ok(arrow::compute::take_record_batch(&sorted, &order)?)
}

/// A quoted column name, so case and dots are kept as given.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn column(name: &str, schema: &SchemaRef) -> Result<Expr> {
    if schema.field_with_name(name).is_err() {
        let have: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        return Err(Error::Plan(format!(
            "unknown column {name:?} (have {})",
            have.join(", ")
        )));
    }
    Ok(col(ident(name)))
}

/// Converts a plan [`Value`] to a DataFusion expression, checking columns
/// against `schema`.
pub fn expr(v: &Value, schema: &SchemaRef) -> Result<Expr> {
    Ok(match v {
        Value::Column(c) => column(c, schema)?,
        Value::Decimal(s) => lit(decimal(s)?),
        Value::Date(s) => lit(ScalarValue::Date32(Some(date32(s)?))),
        Value::Int(i) => lit(*i),
        Value::Str(s) => lit(s.as_str()),
        Value::Add(a, b) => expr(a, schema)? + expr(b, schema)?,
        Value::Sub(a, b) => expr(a, schema)? - expr(b, schema)?,
        Value::Mul(a, b) => expr(a, schema)? * expr(b, schema)?,
    })
}

/// Parses a decimal literal (`-12.345`) into a Decimal128 scalar.
pub fn decimal(s: &str) -> Result<ScalarValue> {
    let bad = || Error::Plan(format!("bad decimal literal {s:?}"));
    let (neg, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let all = format!("{int}{frac}");
    if all.len() > 38 {
        return Err(bad());
    }
    let mut v: i128 = all.parse().map_err(|_| bad())?;
    if neg {
        v = -v;
    }
    let precision = all.len().max(1) as u8;
    Ok(ScalarValue::Decimal128(
        Some(v),
        precision,
        frac.len() as i8,
    ))
}

/// Days since 1970-01-01 of a `YYYY-MM-DD` date.
pub fn date32(s: &str) -> Result<i32> {
    let bad = || Error::Plan(format!("bad date literal {s:?} (want YYYY-MM-DD)"));
    let parts: Vec<&str> = s.split('-').collect();
    if parts.len() != 3 {
        return Err(bad());
    }
    let y: i64 = parts[0].parse().map_err(|_| bad())?;
    let m: i64 = parts[1].parse().map_err(|_| bad())?;
    let d: i64 = parts[2].parse().map_err(|_| bad())?;
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let mdays = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&m) || d < 1 || d > mdays[(m - 1) as usize] {
        return Err(bad());
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = if y2 >= 0 { y2 } else { y2 - 399 } / 400;
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Ok((era * 146097 + doe - 719468) as i32)
}

/// Casts the columns for which `to` names a type to that type; the others
/// are kept as they are.
pub fn retype(batch: &RecordBatch, to: impl Fn(&Field) -> Option<DataType>) -> Result<RecordBatch> {
    let schema = batch.schema();
    let mut fields = Vec::with_capacity(schema.fields().len());
    let mut cols = Vec::with_capacity(schema.fields().len());
    for (f, c) in schema.fields().iter().zip(batch.columns()) {
        match to(f).filter(|t| t != f.data_type()) {
            Some(t) => {
                cols.push(arrow::compute::cast(c, &t)?);
                fields.push(Arc::new(f.as_ref().clone().with_data_type(t)));
            }
            None => {
                cols.push(c.clone());
                fields.push(f.clone());
            }
        }
    }
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone())),
        cols,
    )?)
}

/// The plain layout every reader handles (DuckDB's input, for one):
/// strings as Utf8, decimals as Decimal128 of the same precision and scale.
pub fn plain_types(batch: &RecordBatch) -> Result<RecordBatch> {
    retype(batch, |f| match f.data_type() {
        DataType::Utf8View | DataType::Dictionary(..) => Some(DataType::Utf8),
        DataType::Decimal32(p, s) | DataType::Decimal64(p, s) => Some(DataType::Decimal128(*p, *s)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::Int8Type;
    use proptest::prelude::*;

    fn keyed_schema() -> SchemaRef {
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        Arc::new(Schema::new(vec![
            Field::new("flag", dict, true),
            Field::new("status", DataType::Utf8, false),
            Field::new("v", DataType::Int64, true),
        ]))
    }

    /// One batch: flag `None` is a null key; `dictionary` holds the
    /// batch's own flag values (so batches disagree on their keys).
    fn keyed_batch(
        dictionary: &[&str],
        rows: &[(Option<usize>, &str, Option<i64>)],
    ) -> RecordBatch {
        let keys: Vec<Option<i8>> = rows.iter().map(|r| r.0.map(|k| k as i8)).collect();
        let flag = DictionaryArray::<Int8Type>::try_new(
            keys.into(),
            Arc::new(StringArray::from(dictionary.to_vec())),
        )
        .unwrap();
        RecordBatch::try_new(
            keyed_schema(),
            vec![
                Arc::new(flag),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.1))),
                Arc::new(Int64Array::from(
                    rows.iter().map(|r| r.2).collect::<Vec<_>>(),
                )),
            ],
        )
        .unwrap()
    }

    fn bundle() -> (Vec<String>, Vec<Aggregate>) {
        let agg = |func, name: &str| Aggregate {
            func,
            arg: Value::col("v"),
            name: name.into(),
        };
        (
            vec!["flag".into(), "status".into()],
            vec![
                agg(AggFunc::Sum, "s"),
                agg(AggFunc::Count, "c"),
                agg(AggFunc::Avg, "a"),
                agg(AggFunc::Min, "lo"),
                agg(AggFunc::Max, "hi"),
            ],
        )
    }

    /// The bundle through DataFusion's hash aggregate, as one batch.
    async fn hashed(input: Vec<RecordBatch>) -> RecordBatch {
        let (group_by, aggregates) = bundle();
        let ctx = context();
        let df = grouped(
            frame(&ctx, keyed_schema(), input).unwrap(),
            &group_by,
            &aggregates,
            &keyed_schema(),
        )
        .unwrap();
        let schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
        let out = df.collect().await.unwrap();
        arrow::compute::concat_batches(&schema, &out).unwrap()
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// Flag, quantity, price, discount and tax of 2,100 rows in three
    /// batches of one flag each, as Q1's Sort leaves them, in Q1's types.
    fn q1_like_input() -> (SchemaRef, Vec<RecordBatch>) {
        use arrow::array::Decimal64Array;
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        let dec = DataType::Decimal64(15, 2);
        let schema: SchemaRef = Arc::new(Schema::new(vec![
            Field::new("flag", dict, false),
            Field::new("qty", dec.clone(), false),
            Field::new("price", dec.clone(), false),
            Field::new("disc", dec.clone(), false),
            Field::new("tax", dec, false),
        ]));
        let decimals = |f: &dyn Fn(i64) -> i64, rows: std::ops::Range<i64>| -> ArrayRef {
            Arc::new(
                Decimal64Array::from_iter_values(rows.map(f))
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            )
        };
        // Three batches of one flag each, as the Sort leaves them.
        let input: Vec<RecordBatch> = ["A", "N", "R"]
            .iter()
            .enumerate()
            .map(|(i, flag)| {
                let rows = (i as i64 * 1000)..(i as i64 * 1000 + 700);
                let flags = DictionaryArray::<Int8Type>::try_new(
                    vec![0i8; 700].into(),
                    Arc::new(StringArray::from(vec![*flag])),
                )
                .unwrap();
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(flags),
                        decimals(&|r| (r % 50 + 1) * 100, rows.clone()),
                        decimals(&|r| 90_000 + r * 37 % 10_000_000, rows.clone()),
                        decimals(&|r| r % 11, rows.clone()),
                        decimals(&|r| r % 9, rows),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, input)
    }

    #[test]
    fn a_q1_like_bundle_of_decimals_takes_the_exact_path_and_equals_the_hash_aggregate() {
        let (schema, input) = q1_like_input();
        let price = || Value::col("price");
        let one = || Value::Decimal("1.00".into());
        let disc_price = || Value::times(price(), Value::minus(one(), Value::col("disc")));
        let agg = |func, arg, name: &str| Aggregate {
            func,
            arg,
            name: name.into(),
        };
        let aggregates = vec![
            agg(AggFunc::Sum, Value::col("qty"), "sum_qty"),
            agg(AggFunc::Sum, price(), "sum_base_price"),
            agg(AggFunc::Sum, disc_price(), "sum_disc_price"),
            agg(
                AggFunc::Sum,
                Value::times(disc_price(), Value::plus(one(), Value::col("tax"))),
                "sum_charge",
            ),
            agg(AggFunc::Count, Value::col("qty"), "count_order"),
        ];
        let group_by = vec!["flag".to_string()];
        let ctx = context();
        let df = grouped(
            frame(&ctx, schema.clone(), input.clone()).unwrap(),
            &group_by,
            &aggregates,
            &schema,
        )
        .unwrap();
        let want: SchemaRef = Arc::new(df.schema().as_arrow().clone());
        let hashed = block_on(df.collect()).unwrap();
        let hashed = arrow::compute::concat_batches(&want, &hashed).unwrap();
        let groups = rungroup::group_ids(&input, &[0]).unwrap().unwrap();
        let exact = exactsum::aggregate(
            &schema,
            &input,
            &groups.ids,
            groups.groups(),
            &aggregates,
            &want.fields()[1..],
        )
        .unwrap();
        assert!(exact.is_some(), "the exact path declined: {want:?}");
        let bundle = Primitive::AggGrpSort {
            group_by,
            aggregates,
        };
        let (_, by_runs) = block_on(run(&bundle, schema, input)).unwrap();
        assert_eq!(by_runs, vec![hashed]);
    }

    proptest! {
        #[test]
        fn the_bundle_by_runs_equals_the_hash_aggregate(
            blocks in proptest::collection::vec(
                (
                    proptest::collection::vec("[A-C]", 1..4),
                    proptest::collection::vec(
                        (proptest::option::weighted(0.9, 0usize..8), 0usize..2, proptest::option::weighted(0.8, -50i64..50)),
                        0..120,
                    ),
                ),
                1..5,
            ),
            sort_first in any::<bool>(),
        ) {
            let statuses = ["F", "O"];
            let mut input: Vec<RecordBatch> = blocks
                .iter()
                .map(|(dictionary, rows)| {
                    let dictionary: Vec<&str> = dictionary.iter().map(String::as_str).collect();
                    let rows: Vec<(Option<usize>, &str, Option<i64>)> = rows
                        .iter()
                        .map(|&(k, s, v)| (k.map(|k| k % dictionary.len()), statuses[s], v))
                        .collect();
                    keyed_batch(&dictionary, &rows)
                })
                .collect();
            if sort_first {
                // Clustered input, as Q1's Sort leaves it: the run path runs.
                let sort = Primitive::Sort {
                    keys: vec![
                        crate::plan::SortKey::asc("flag"),
                        crate::plan::SortKey::asc("status"),
                    ],
                };
                input = block_on(run(&sort, keyed_schema(), input)).unwrap().1;
            }
            let (group_by, aggregates) = bundle();
            let keys = [0, 1];
            let clustered = rungroup::group_ids(&input, &keys).unwrap().is_some();
            let by_runs = block_on(aggregate_by_runs(
                &keyed_schema(), &input, &group_by, &aggregates, None,
            ))
            .unwrap();
            prop_assert_eq!(by_runs.is_some(), clustered);
            let want = block_on(hashed(input.clone()));
            if let Some((schema, got)) = by_runs {
                prop_assert_eq!(&schema, &want.schema());
                let got = arrow::compute::concat_batches(&schema, &got).unwrap();
                prop_assert_eq!(got, want.clone());
            }
            let (schema, through_run) = block_on(run(
                &Primitive::AggGrpSort { group_by, aggregates },
                keyed_schema(),
                input,
            )).unwrap();
            let through_run = arrow::compute::concat_batches(&schema, &through_run).unwrap();
            prop_assert_eq!(through_run, want);
        }
    }

    #[test]
    fn dates_convert_to_days_since_the_epoch() {
        assert_eq!(date32("1970-01-01").unwrap(), 0);
        assert_eq!(date32("1998-09-02").unwrap(), 10471);
        assert_eq!(date32("2000-03-01").unwrap(), 11017);
        assert!(date32("1998-02-30").is_err());
        assert!(date32("1998-9").is_err());
    }

    #[test]
    fn decimals_parse_exactly() {
        assert_eq!(
            decimal("1.00").unwrap(),
            ScalarValue::Decimal128(Some(100), 3, 2)
        );
        assert_eq!(
            decimal("-0.5").unwrap(),
            ScalarValue::Decimal128(Some(-5), 2, 1)
        );
        for bad in ["", "1.2.3", "x", "1e5", "-"] {
            assert!(decimal(bad).is_err(), "{bad}");
        }
    }
}
