//! The paper's workloads over TPC-H's `lineitem` (section 4): the selective
//! *Scan* and Q1, with Q1 split into the plan of section 4.2,
//! `Scan -> Sort -> Group-by+Aggregate+LocalSort`, and the final merge of
//! the nodes' partial aggregates on the host.
//!
//! Data comes from the `tpchgen` crates, which reproduce dbgen's rows, so
//! Q1 at scale factor 1 must equal the TPC-H reference answer
//! ([`Q1_SF1_ANSWER`]).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, Decimal128Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::functions_aggregate::expr_fn as agg;
use datafusion::prelude::*;

use crate::error::{Error, Result};
use crate::ops;
use crate::plan::{AggFunc, Aggregate, Cmp, Predicate, Primitive, SortKey, Value};

/// Rows per generated batch: one row block of the row-wise layout.
pub const BLOCK_ROWS: usize = 16 * 1024;

/// Largest scale factor the host places (it holds the table in memory).
pub const MAX_SF: f64 = 10.0;

/// Checks a scale factor.
pub fn check_sf(sf: f64) -> Result<()> {
    if !(sf.is_finite() && sf > 0.0 && sf <= MAX_SF) {
        return Err(Error::Invalid(format!(
            "scale factor {sf} out of range: want 0 < sf <= {MAX_SF}"
        )));
    }
    Ok(())
}

/// Columns of few distinct values, stored dictionary-encoded.
const DICTIONARY_COLUMNS: [&str; 4] = [
    "l_returnflag",
    "l_linestatus",
    "l_shipinstruct",
    "l_shipmode",
];

/// The types the nodes store `lineitem` in. TPC-H's DECIMAL(15,2) columns
/// fit 64 bits exactly, so they are Decimal64(15,2) (half the bytes of the
/// generator's Decimal128, as DuckDB keeps them); the one-letter flags and
/// the few-valued shipping columns are dictionary-encoded, so sorting and
/// grouping on them compares small integers. Values are unchanged: Q1 over
/// these types equals the TPC-H answer.
pub fn storage_types(batch: &RecordBatch) -> Result<RecordBatch> {
    ops::retype(batch, |f| {
        if DICTIONARY_COLUMNS.contains(&f.name().as_str()) {
            return Some(DataType::Dictionary(
                Box::new(DataType::Int8),
                Box::new(DataType::Utf8),
            ));
        }
        match f.data_type() {
            DataType::Utf8View => Some(DataType::Utf8),
            DataType::Decimal128(p, s) if *p <= 18 => Some(DataType::Decimal64(*p, *s)),
            _ => None,
        }
    })
}

/// Generates `lineitem` at scale factor `sf`, one batch per row block of
/// [`BLOCK_ROWS`] rows, in the [`storage_types`].
pub fn lineitem(sf: f64) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let (schema, blocks) = lineitem_blocks(sf)?;
    let batches = blocks.collect::<Result<Vec<_>>>()?;
    if batches.is_empty() {
        return Err(Error::Invalid(format!(
            "scale factor {sf} generates no rows"
        )));
    }
    Ok((schema, batches))
}

/// `lineitem` at scale factor `sf` as it is generated, one row block at a
/// time (the same blocks as [`lineitem`]): a table of any scale factor
/// in the memory of one block. The schema is known before the first.
pub fn lineitem_blocks(
    sf: f64,
) -> Result<(
    SchemaRef,
    impl Iterator<Item = Result<RecordBatch>> + Send + 'static,
)> {
    check_sf(sf)?;
    let schema = storage_types(&RecordBatch::new_empty(
        tpchgen_arrow::LineItemArrow::schema_ref(),
    ))?
    .schema();
    let generator = tpchgen::generators::LineItemGenerator::new(sf, 1, 1);
    let blocks = tpchgen_arrow::LineItemArrow::new(generator)
        .with_batch_size(BLOCK_ROWS)
        .map(|b| storage_types(&b?));
    Ok((schema, blocks))
}

/// About how many rows `lineitem` has at scale factor `sf` (its count at
/// scale factor 1, scaled): an estimate for progress bars, not a count.
pub fn lineitem_rows_estimate(sf: f64) -> u64 {
    (6_001_215.0 * sf) as u64
}

/// The Scan workload's primitive: every column of the lineitems shipped in
/// January 1994 (about 1.3% of the table).
pub fn scan_primitive() -> Primitive {
    Primitive::Scan {
        filter: vec![
            Predicate {
                left: Value::col("l_shipdate"),
                cmp: Cmp::Ge,
                right: Value::Date("1994-01-01".into()),
            },
            Predicate {
                left: Value::col("l_shipdate"),
                cmp: Cmp::Lt,
                right: Value::Date("1994-02-01".into()),
            },
        ],
        columns: None,
    }
}

/// `l_extendedprice * (1 - l_discount)`
fn disc_price() -> Value {
    Value::times(
        Value::col("l_extendedprice"),
        Value::minus(Value::Decimal("1.00".into()), Value::col("l_discount")),
    )
}

/// `l_extendedprice * (1 - l_discount) * (1 + l_tax)`
fn charge() -> Value {
    Value::times(
        disc_price(),
        Value::plus(Value::Decimal("1.00".into()), Value::col("l_tax")),
    )
}

/// Aggregates `df` by `(l_returnflag, l_linestatus)`, sorted by them, as
/// one batch.
async fn by_flag_and_status(df: DataFrame, aggs: Vec<Expr>) -> Result<RecordBatch> {
    let c = |n: &str| col(format!("\"{n}\""));
    let df = df
        .aggregate(vec![c("l_returnflag"), c("l_linestatus")], aggs)?
        .sort(vec![
            c("l_returnflag").sort(true, false),
            c("l_linestatus").sort(true, false),
        ])?;
    let batches = df.collect().await?;
    Ok(arrow::compute::concat_batches(
        &batches[0].schema(),
        &batches,
    )?)
}

/// Q1's three primitives, in order: Scan, Sort, and the bundle.
pub fn q1_primitives() -> [Primitive; 3] {
    let price = || Value::col("l_extendedprice");
    [
        Primitive::Scan {
            filter: vec![Predicate {
                left: Value::col("l_shipdate"),
                cmp: Cmp::Le,
                // date '1998-12-01' - interval '90' day
                right: Value::Date("1998-09-02".into()),
            }],
            columns: Some(
                [
                    "l_returnflag",
                    "l_linestatus",
                    "l_quantity",
                    "l_extendedprice",
                    "l_discount",
                    "l_tax",
                ]
                .map(String::from)
                .to_vec(),
            ),
        },
        Primitive::Sort {
            keys: vec![SortKey::asc("l_returnflag"), SortKey::asc("l_linestatus")],
        },
        Primitive::AggGrpSort {
            group_by: vec!["l_returnflag".into(), "l_linestatus".into()],
            aggregates: vec![
                Aggregate {
                    func: AggFunc::Sum,
                    arg: Value::col("l_quantity"),
                    name: "sum_qty".into(),
                },
                Aggregate {
                    func: AggFunc::Sum,
                    arg: price(),
                    name: "sum_base_price".into(),
                },
                Aggregate {
                    func: AggFunc::Sum,
                    arg: disc_price(),
                    name: "sum_disc_price".into(),
                },
                Aggregate {
                    func: AggFunc::Sum,
                    arg: charge(),
                    name: "sum_charge".into(),
                },
                Aggregate {
                    func: AggFunc::Sum,
                    arg: Value::col("l_discount"),
                    name: "sum_disc".into(),
                },
                Aggregate {
                    func: AggFunc::Count,
                    arg: Value::col("l_quantity"),
                    name: "count_order".into(),
                },
            ],
        },
    ]
}

/// Q1's result columns, in TPC-H order.
pub const Q1_COLUMNS: [&str; 10] = [
    "l_returnflag",
    "l_linestatus",
    "sum_qty",
    "sum_base_price",
    "sum_disc_price",
    "sum_charge",
    "avg_qty",
    "avg_price",
    "avg_disc",
    "count_order",
];

/// The TPC-H reference answer of Q1 at scale factor 1, as CSV rows.
pub const Q1_SF1_ANSWER: [&str; 4] = [
    "A,F,37734107.00,56586554400.73,53758257134.87,55909065222.83,25.52,38273.13,0.05,1478493",
    "N,F,991417.00,1487504710.38,1413082168.05,1469649223.19,25.52,38284.47,0.05,38854",
    "N,O,74476040.00,111701729697.74,106118230307.61,110367043872.50,25.50,38249.12,0.05,2920374",
    "R,F,37719753.00,56568041380.90,53741292684.60,55889619119.83,25.51,38250.85,0.05,1478870",
];

/// Merges the nodes' partial aggregates (the output of Q1's bundle on each
/// node) into Q1's answer: DataFusion sums the partials per group; the
/// averages are the summed values over the summed counts. Decimals are
/// rounded half away from zero to 2 places, as the TPC-H answer set prints
/// them.
pub async fn q1_merge(schema: SchemaRef, partials: Vec<RecordBatch>) -> Result<RecordBatch> {
    let ctx = ops::context();
    let df = ops::frame(&ctx, schema, partials)?;
    let sums = [
        "sum_qty",
        "sum_base_price",
        "sum_disc_price",
        "sum_charge",
        "sum_disc",
        "count_order",
    ];
    let merged = by_flag_and_status(
        df,
        sums.iter()
            .map(|s| agg::sum(col(format!("\"{s}\""))).alias(*s))
            .collect(),
    )
    .await?;
    let get = |n: &str| merged.column_by_name(n).expect("merged column").clone();
    let counts = get("count_order");
    let counts = counts
        .as_any()
        .downcast_ref::<Int64Array>()
        .expect("count is Int64");
    let round = |a: &ArrayRef| round2(a, None);
    let avg = |a: &ArrayRef| round2(a, Some(counts));
    build_q1(
        &merged,
        [
            round(&get("sum_qty"))?,
            round(&get("sum_base_price"))?,
            round(&get("sum_disc_price"))?,
            round(&get("sum_charge"))?,
            avg(&get("sum_qty"))?,
            avg(&get("sum_base_price"))?,
            avg(&get("sum_disc"))?,
        ],
    )
}

/// Q1 in one DataFusion run over the whole table: the reference the
/// distributed plan must equal.
pub async fn q1_single(schema: SchemaRef, batches: Vec<RecordBatch>) -> Result<RecordBatch> {
    let ctx = ops::context();
    let [scan, _, _] = q1_primitives();
    let (s, scanned) = ops::run(&scan, schema, batches).await?;
    let df = ops::frame(&ctx, s.clone(), scanned)?;
    let c = |n: &str| col(format!("\"{n}\""));
    let m = by_flag_and_status(
        df,
        vec![
            agg::sum(c("l_quantity")).alias("sum_qty"),
            agg::sum(c("l_extendedprice")).alias("sum_base_price"),
            agg::sum(ops::expr(&disc_price(), &s)?).alias("sum_disc_price"),
            agg::sum(ops::expr(&charge(), &s)?).alias("sum_charge"),
            agg::avg(c("l_quantity")).alias("avg_qty"),
            agg::avg(c("l_extendedprice")).alias("avg_price"),
            agg::avg(c("l_discount")).alias("avg_disc"),
            agg::count(c("l_quantity")).alias("count_order"),
        ],
    )
    .await?;
    let mut decs = Vec::new();
    for n in &Q1_COLUMNS[2..9] {
        decs.push(round2(m.column_by_name(n).expect("column"), None)?);
    }
    build_q1(&m, decs.try_into().expect("7 columns"))
}

/// Row blocks a streamed reference run works on at once (about a million
/// rows).
const REFERENCE_CHUNK: usize = 64;

/// Q1 in one process over a table that arrives as a stream of row blocks,
/// in the memory of [`REFERENCE_CHUNK`] of them: each chunk is filtered by
/// Q1's Scan and hash-aggregated by DataFusion into partial sums (no Sort,
/// no nodes), and the partials are merged as the host merges the nodes'.
/// The reference at scale factors too large for [`q1_single`].
pub async fn q1_streamed(
    schema: SchemaRef,
    blocks: impl Iterator<Item = Result<RecordBatch>>,
) -> Result<RecordBatch> {
    let [scan, _, bundle] = q1_primitives();
    let mut partials = Vec::new();
    let mut partial_schema = None;
    for chunk in chunks(blocks) {
        let (s, scanned) = ops::run(&scan, schema.clone(), chunk?).await?;
        let (ps, part) = ops::run(&bundle, s, scanned).await?;
        partial_schema = Some(ps);
        partials.extend(part);
    }
    let Some(ps) = partial_schema else {
        return Err(Error::Invalid("no rows to run Q1 over".into()));
    };
    q1_merge(ps, partials).await
}

/// The Scan workload in one process over a streamed table (see
/// [`q1_streamed`]), rows ordered by `(l_orderkey, l_linenumber)`.
pub async fn scan_streamed(
    schema: SchemaRef,
    blocks: impl Iterator<Item = Result<RecordBatch>>,
) -> Result<Vec<RecordBatch>> {
    let scan = scan_primitive();
    let mut rows = Vec::new();
    let mut out_schema = schema.clone();
    for chunk in chunks(blocks) {
        let (s, scanned) = ops::run(&scan, schema.clone(), chunk?).await?;
        out_schema = s;
        rows.extend(scanned);
    }
    order_scan(out_schema, rows).await
}

/// `blocks` [`REFERENCE_CHUNK`] at a time.
fn chunks(
    blocks: impl Iterator<Item = Result<RecordBatch>>,
) -> impl Iterator<Item = Result<Vec<RecordBatch>>> {
    let mut blocks = blocks.peekable();
    std::iter::from_fn(move || {
        blocks.peek()?;
        Some(blocks.by_ref().take(REFERENCE_CHUNK).collect())
    })
}

/// Q1's answer batch: the group keys and `count_order` from `groups`, the
/// seven rounded decimal columns given.
fn build_q1(groups: &RecordBatch, decs: [ArrayRef; 7]) -> Result<RecordBatch> {
    let get = |n: &str| groups.column_by_name(n).expect("group column").clone();
    let flag = arrow::compute::cast(&get("l_returnflag"), &DataType::Utf8)?;
    let status = arrow::compute::cast(&get("l_linestatus"), &DataType::Utf8)?;
    let mut fields = vec![
        Field::new(Q1_COLUMNS[0], DataType::Utf8, false),
        Field::new(Q1_COLUMNS[1], DataType::Utf8, false),
    ];
    for n in &Q1_COLUMNS[2..9] {
        fields.push(Field::new(*n, DataType::Decimal128(38, 2), true));
    }
    fields.push(Field::new(Q1_COLUMNS[9], DataType::Int64, true));
    let mut cols = vec![flag, status];
    cols.extend(decs);
    cols.push(get("count_order"));
    Ok(RecordBatch::try_new(Arc::new(Schema::new(fields)), cols)?)
}

/// Rounds a Decimal128 column (optionally divided by `divisor` first) to 2
/// decimal places, half away from zero.
fn round2(a: &ArrayRef, divisor: Option<&Int64Array>) -> Result<ArrayRef> {
    let wide;
    let a = match a.data_type() {
        DataType::Decimal32(_, s) | DataType::Decimal64(_, s) => {
            wide = arrow::compute::cast(a, &DataType::Decimal128(38, *s))?;
            &wide
        }
        _ => a,
    };
    let (scale, values) = match a.data_type() {
        DataType::Decimal128(_, s) => (
            *s as u32,
            a.as_any()
                .downcast_ref::<Decimal128Array>()
                .expect("decimal"),
        ),
        other => {
            return Err(Error::Plan(format!(
                "expected a decimal column, got {other}"
            )));
        }
    };
    let out: Decimal128Array = (0..values.len())
        .map(|i| {
            if values.is_null(i) {
                return None;
            }
            let v = values.value(i);
            // value / 10^scale / d, to 2 places: v * 100 / (10^scale * d).
            let d = divisor.map_or(1, |d| d.value(i) as i128).max(1);
            let den = 10i128.pow(scale) * d;
            let num = v * 100;
            let q = num / den;
            let r = num % den;
            Some(if 2 * r.abs() >= den {
                q + num.signum()
            } else {
                q
            })
        })
        .collect();
    Ok(Arc::new(out.with_precision_and_scale(38, 2)?))
}

/// Formats batches as CSV: a header line, then one line per row.
pub fn to_csv(batches: &[RecordBatch]) -> Result<String> {
    let mut out = String::new();
    let Some(first) = batches.first() else {
        return Ok(out);
    };
    let schema = first.schema();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    out.push_str(&names.join(","));
    out.push('\n');
    let opts = FormatOptions::default();
    for b in batches {
        let fmts = b
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &opts))
            .collect::<Result<Vec<_>, _>>()?;
        for row in 0..b.num_rows() {
            for (i, f) in fmts.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let cell = f.value(row).to_string();
                if cell.contains([',', '"', '\n']) {
                    out.push('"');
                    out.push_str(&cell.replace('"', "\"\""));
                    out.push('"');
                } else {
                    out.push_str(&cell);
                }
            }
            out.push('\n');
        }
    }
    Ok(out)
}

/// The Scan workload in one DataFusion run, rows ordered by
/// `(l_orderkey, l_linenumber)`: the reference for the distributed Scan.
pub async fn scan_single(schema: SchemaRef, batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
    let (s, rows) = ops::run(&scan_primitive(), schema, batches).await?;
    order_scan(s, rows).await
}

/// Orders Scan results by `(l_orderkey, l_linenumber)`.
pub async fn order_scan(schema: SchemaRef, rows: Vec<RecordBatch>) -> Result<Vec<RecordBatch>> {
    let (_, out) = ops::run(
        &Primitive::Sort {
            keys: vec![SortKey::asc("l_orderkey"), SortKey::asc("l_linenumber")],
        },
        schema,
        rows,
    )
    .await?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streamed_references_equal_the_whole_table_runs() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let sf = 0.02;
        let (schema, batches) = lineitem(sf).unwrap();
        let (s, blocks) = lineitem_blocks(sf).unwrap();
        assert_eq!(s, schema);
        let streamed = rt.block_on(q1_streamed(s, blocks)).unwrap();
        let whole = rt
            .block_on(q1_single(schema.clone(), batches.clone()))
            .unwrap();
        assert_eq!(to_csv(&[streamed]).unwrap(), to_csv(&[whole]).unwrap());
        let (s, blocks) = lineitem_blocks(sf).unwrap();
        let streamed = rt.block_on(scan_streamed(s, blocks)).unwrap();
        let whole = rt.block_on(scan_single(schema, batches)).unwrap();
        assert_eq!(to_csv(&streamed).unwrap(), to_csv(&whole).unwrap());
    }

    #[test]
    fn q1s_bundle_over_its_sorted_input_equals_the_hash_aggregate() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (schema, batches) = lineitem(0.02).unwrap();
        let [scan, sort, bundle] = q1_primitives();
        let (s, scanned) = rt.block_on(ops::run(&scan, schema, batches)).unwrap();
        // Unsorted input has short runs: DataFusion's hash aggregate.
        let (_, hashed) = rt
            .block_on(ops::run(&bundle, s.clone(), scanned.clone()))
            .unwrap();
        let (s, sorted) = rt.block_on(ops::run(&sort, s, scanned)).unwrap();
        // Sorted input: groups by runs, sums by exact integer arithmetic.
        let (_, by_runs) = rt.block_on(ops::run(&bundle, s, sorted)).unwrap();
        assert_eq!(by_runs, hashed);
    }

    #[test]
    fn scale_factors_out_of_range_are_refused() {
        for sf in [0.0, -1.0, f64::NAN, 11.0, f64::INFINITY] {
            let e = check_sf(sf).unwrap_err().to_string();
            assert!(e.contains("out of range"), "{e}");
        }
        check_sf(0.01).unwrap();
    }
}
