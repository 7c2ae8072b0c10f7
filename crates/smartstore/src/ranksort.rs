//! The Sort primitive on dictionary-encoded keys, by normalized key.
//!
//! Q1's Sort (section 4.2 of the smart-storage paper: Scan, then Sort, then
//! the bundle) orders a node's rows by `l_returnflag, l_linestatus`, two
//! dictionary-encoded one-letter columns (see `tpch::storage_types`).
//! DataFusion's `SortExec` sorts two such keys with arrow's lexicographic
//! comparator, which looks both dictionaries up and compares the strings
//! for every pair of rows: at 1.5 million rows a node that is most of Q1's
//! time. A column with a handful of distinct values sorts far faster by
//! *normalized key*, as arrow-row and DuckDB do it: rank each dictionary's
//! few values once (arrow's `rank`), give each row its value's rank (arrow's
//! `take` through the dictionary keys), fold the ranks of all keys into one
//! unsigned integer whose order is the keys' lexicographic order, and sort
//! that one primitive column (arrow's `sort_to_indices`), then gather the
//! rows (arrow's `take`). Every step is an arrow kernel; this file only
//! chooses them.
//!
//! Each batch may carry its own dictionary, so the values of all the
//! batches' dictionaries are ranked together (a few hundred values for Q1's
//! 92 row blocks) and the ranks made dense, `0 .. d_i` for key `i`. The
//! normalized key of a row with key ranks `r_0 .. r_k` is
//! `sum r_i * prod_{j > i} d_j`: a mixed-radix number whose digits are the
//! ranks, most significant first, so comparing two normalized keys compares
//! the ranks lexicographically. A descending key ranks its values
//! descending. [`sort`] declines (returns `None`, and the caller uses
//! DataFusion's sort) when a key is not dictionary-encoded, a key has null
//! rows or null values, or the radix product does not fit 64 bits.
//!
//! When the normalized key takes at most [`MAX_BUCKETS`] values (6 for
//! Q1: three return flags by two line statuses) the rows are not sorted but
//! bucketed, a stable counting sort: one byte per row names its bucket, a
//! histogram gives where each bucket starts, and each fixed-width column
//! without nulls (Q1's four decimals) is *scattered*, every value written
//! straight to the next place of its bucket in one sequential pass over
//! the input. At scale factor 10 (15 million rows a node) that replaced
//! gathering the concatenated columns through a row order, whose random
//! reads over 120 MB columns made the Sort most of Q1's time. A column of
//! another type, or with nulls, is gathered through the row order (itself
//! scattered once). The bucket sizes then give the sorted key columns
//! without moving them: bucket `v` holds the rows whose key `i` has digit
//! `(v / weight_i) % d_i`, so each key column is a run of that digit per
//! bucket over one dictionary of the ranked values.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayData, ArrayRef, AsArray, DictionaryArray, UInt32Array, UInt64Array, make_array,
};
use arrow::buffer::Buffer;
use arrow::compute::{
    SortOptions, cast, concat, concat_batches, rank, sort_to_indices, take, take_record_batch,
};
use arrow::datatypes::ArrowNativeType;
use arrow::datatypes::UInt32Type;
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;

use crate::error::Result;

/// One sort key: a column index and its direction.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Index of the column in the batches' schema.
    pub column: usize,
    /// Descending instead of ascending.
    pub descending: bool,
}

/// Sorts `batches` by `keys` through a normalized key, returning the rows
/// in order as batches of at most `batch_rows` rows; `None` when the keys do
/// not qualify (see the module documentation) and the caller must sort
/// another way.
pub fn sort(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    keys: &[Key],
    batch_rows: usize,
) -> Result<Option<Vec<RecordBatch>>> {
    assert!(batch_rows > 0, "batches of zero rows");
    if keys.is_empty()
        || !keys
            .iter()
            .all(|k| matches!(schema.field(k.column).data_type(), DataType::Dictionary(..)))
    {
        return Ok(None);
    }
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    if rows == 0 {
        return Ok(Some(Vec::new()));
    }
    if rows > u32::MAX as usize {
        return Ok(None);
    }
    // (key, its weight, its digits), least significant key first, so each
    // key's weight is the product of the radixes after it.
    let mut weights: Vec<(Key, u64, Digits)> = Vec::with_capacity(keys.len());
    let mut radix: u64 = 1;
    for key in keys.iter().rev() {
        let Some(digits) = Digits::of(batches, *key)? else {
            return Ok(None);
        };
        let Some(next_radix) = radix.checked_mul(digits.radix) else {
            return Ok(None);
        };
        weights.push((*key, radix, digits));
        radix = next_radix;
    }
    if radix <= MAX_BUCKETS {
        let bucket = normalized::<u8>(batches, &weights, rows)?;
        return Ok(Some(by_buckets(
            schema, batches, &bucket, radix, &weights, batch_rows,
        )?));
    }
    let normalized = normalized::<u64>(batches, &weights, rows)?;
    let order = sort_to_indices(&UInt64Array::from(normalized), None, None)?;
    let sorted = take_record_batch(&concat_batches(schema, batches)?, &order)?;
    Ok(Some(
        (0..rows)
            .step_by(batch_rows)
            .map(|start| sorted.slice(start, batch_rows.min(rows - start)))
            .collect(),
    ))
}

/// The normalized key of each of the `rows` rows of `batches`, in `T`
/// (which must hold the radix product of `weights`).
fn normalized<T>(
    batches: &[RecordBatch],
    weights: &[(Key, u64, Digits)],
    rows: usize,
) -> Result<Vec<T>>
where
    T: Copy + Default + TryFrom<u64> + std::ops::AddAssign,
{
    let mut normalized = vec![T::default(); rows];
    for (key, weight, digits) in weights {
        // Each dictionary key's digit times the key's weight, per batch.
        let mut row = 0;
        for (batch, table) in batches.iter().zip(&digits.tables) {
            let scaled: Vec<T> = table
                .iter()
                .map(|&d| {
                    T::try_from(d * weight)
                        .ok()
                        .expect("within the radix product")
                })
                .collect();
            let column = batch.column(key.column).as_any_dictionary();
            let dictionary_keys = cast(column.keys(), &DataType::UInt32)?;
            for &k in dictionary_keys.as_primitive::<UInt32Type>().values() {
                normalized[row] += scaled[k as usize];
                row += 1;
            }
        }
        debug_assert_eq!(row, rows);
    }
    Ok(normalized)
}

/// The rows in order of their bucket (`bucket[r]`, below `radix`, at most
/// [`MAX_BUCKETS`]), as batches of at most `batch_rows` rows each holding
/// one bucket: the key columns rebuilt from the bucket, the fixed-width
/// columns scattered, any other column gathered.
fn by_buckets(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    bucket: &[u8],
    radix: u64,
    weights: &[(Key, u64, Digits)],
    batch_rows: usize,
) -> Result<Vec<RecordBatch>> {
    assert!(radix <= MAX_BUCKETS, "a bucket number fits a byte");
    let mut counts = vec![0usize; radix as usize];
    for &b in bucket {
        counts[b as usize] += 1;
    }
    // The output batches, in order: (bucket, rows), each bucket's rows in
    // batches of `batch_rows` and one shorter last one.
    let layout: Vec<(u64, usize)> = (0..radix)
        .flat_map(|v| {
            let n = counts[v as usize];
            (0..n)
                .step_by(batch_rows)
                .map(move |at| (v, batch_rows.min(n - at)))
        })
        .collect();
    let mut columns: Vec<Option<Vec<ArrayRef>>> = vec![None; schema.fields().len()];
    // The key columns follow from the buckets: bucket `v` holds the rows
    // whose key `i` has the value of digit `(v / weight_i) % radix_i`, one
    // value for the whole batch.
    for (key, weight, digits) in weights {
        let mut parts = Vec::with_capacity(layout.len());
        for &(value, len) in &layout {
            let digit = ((value / weight) % digits.radix) as u32;
            let column = DictionaryArray::<UInt32Type>::try_new(
                UInt32Array::from(vec![digit; len]),
                digits.values.clone(),
            )?;
            parts.push(cast(&column, schema.field(key.column).data_type())?);
        }
        columns[key.column] = Some(parts);
    }
    // Fixed-width columns without nulls are scattered straight to their
    // place, one sequential pass each; any other column is gathered by the
    // row order (itself scattered once).
    let mut gather = Vec::new();
    for (c, slot) in columns.iter_mut().enumerate() {
        if slot.is_some() {
            continue;
        }
        match scatter_fixed(batches, c, bucket, &counts, batch_rows)? {
            Some(parts) => *slot = Some(parts),
            None => gather.push(c),
        }
    }
    if !gather.is_empty() {
        let parts = gather_parts(schema, batches, bucket, &counts, &gather, &layout)?;
        for (c, p) in gather.into_iter().zip(parts) {
            columns[c] = Some(p);
        }
    }
    let mut columns: Vec<std::vec::IntoIter<ArrayRef>> = columns
        .into_iter()
        .map(|c| {
            c.expect("every column rebuilt, scattered or gathered")
                .into_iter()
        })
        .collect();
    layout
        .iter()
        .map(|_| {
            let batch: Vec<ArrayRef> = columns
                .iter_mut()
                .map(|c| c.next().expect("a part per output batch"))
                .collect();
            Ok(RecordBatch::try_new(schema.clone(), batch)?)
        })
        .collect()
}

/// The columns `gather` of `batches` in bucket order, gathered through the
/// row order (scattered once), cut into the output batches' parts.
fn gather_parts(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    bucket: &[u8],
    counts: &[usize],
    gather: &[usize],
    layout: &[(u64, usize)],
) -> Result<Vec<Vec<ArrayRef>>> {
    let mut starts: Vec<usize> = counts
        .iter()
        .scan(0, |at, &c| {
            let s = *at;
            *at += c;
            Some(s)
        })
        .collect();
    let mut order = vec![0u32; bucket.len()];
    for (r, &b) in bucket.iter().enumerate() {
        order[starts[b as usize]] = r as u32;
        starts[b as usize] += 1;
    }
    let projected = batches
        .iter()
        .map(|b| b.project(gather))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let gathered = take_record_batch(
        &concat_batches(&Arc::new(schema.project(gather)?), &projected)?,
        &UInt32Array::from(order),
    )?;
    Ok((0..gather.len())
        .map(|from| {
            let column = gathered.column(from);
            let mut at = 0;
            layout
                .iter()
                .map(|&(_, len)| {
                    at += len;
                    column.slice(at - len, len)
                })
                .collect()
        })
        .collect())
}

/// Column `c` of `batches` in bucket order, in the output batches'
/// parts (see [`by_buckets`]), when it is a fixed-width primitive without
/// nulls; `None` otherwise.
fn scatter_fixed(
    batches: &[RecordBatch],
    c: usize,
    bucket: &[u8],
    counts: &[usize],
    batch_rows: usize,
) -> Result<Option<Vec<ArrayRef>>> {
    let Some(first) = batches.first() else {
        return Ok(None);
    };
    let data_type = first.column(c).data_type().clone();
    if !data_type.is_primitive() || batches.iter().any(|b| b.column(c).null_count() > 0) {
        return Ok(None);
    }
    let buffers = match data_type.primitive_width() {
        Some(1) => scatter::<u8>(batches, c, bucket, counts, batch_rows),
        Some(2) => scatter::<u16>(batches, c, bucket, counts, batch_rows),
        Some(4) => scatter::<u32>(batches, c, bucket, counts, batch_rows),
        Some(8) => scatter::<u64>(batches, c, bucket, counts, batch_rows),
        Some(16) => scatter::<i128>(batches, c, bucket, counts, batch_rows),
        _ => return Ok(None),
    };
    buffers
        .into_iter()
        .map(|(len, buffer)| {
            let data = ArrayData::builder(data_type.clone())
                .len(len)
                .add_buffer(buffer)
                .build()?;
            Ok(make_array(data))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The values of column `c` (of `T`'s width) in bucket order, as the
/// output batches' parts: each bucket's values in parts of `batch_rows`.
/// Parts that small come from the heap and are reused from one sort to
/// the next; one buffer for a whole column (120 MB at scale factor 10)
/// would be fresh pages, faulted in and zeroed on every sort.
fn scatter<T: ArrowNativeType>(
    batches: &[RecordBatch],
    c: usize,
    bucket: &[u8],
    counts: &[usize],
    batch_rows: usize,
) -> Vec<(usize, Buffer)> {
    let mut done: Vec<Vec<Vec<T>>> = vec![Vec::new(); counts.len()];
    let mut left = counts.to_vec();
    let mut current: Vec<Vec<T>> = left
        .iter()
        .map(|&n| Vec::with_capacity(n.min(batch_rows)))
        .collect();
    let mut r = 0;
    for b in batches {
        let data = b.column(c).to_data();
        let values =
            &data.buffers()[0].typed_data::<T>()[data.offset()..data.offset() + data.len()];
        for (&v, &k) in values.iter().zip(&bucket[r..r + values.len()]) {
            let k = k as usize;
            let part = &mut current[k];
            if part.len() == batch_rows {
                left[k] -= batch_rows;
                let next = Vec::with_capacity(left[k].min(batch_rows));
                done[k].push(std::mem::replace(part, next));
            }
            current[k].push(v);
        }
        r += values.len();
    }
    debug_assert_eq!(r, bucket.len());
    let mut out = Vec::new();
    for (mut parts, last) in done.into_iter().zip(current) {
        if !last.is_empty() {
            parts.push(last);
        }
        out.extend(parts.into_iter().map(|p| (p.len(), Buffer::from_vec(p))));
    }
    out
}

/// Normalized keys with at most this many distinct values are ordered by
/// bucket (one `eq` and one `filter` pass per value) instead of sorted.
pub const MAX_BUCKETS: u64 = 64;

/// One key's digit per dictionary value, for every batch.
struct Digits {
    /// `tables[b][k]`: the digit of dictionary key `k` in batch `b`.
    tables: Vec<Vec<u64>>,
    /// Distinct digits: every digit is below this.
    radix: u64,
    /// The value of each digit, in digit order.
    values: ArrayRef,
}

impl Digits {
    /// Ranks the values of every batch's dictionary of `key` together;
    /// `None` when the column does not qualify.
    fn of(batches: &[RecordBatch], key: Key) -> Result<Option<Digits>> {
        let mut values: Vec<ArrayRef> = Vec::with_capacity(batches.len());
        for b in batches {
            let column = b.column(key.column);
            if column.null_count() > 0 {
                return Ok(None);
            }
            let dictionary = column.as_any_dictionary();
            if dictionary.values().null_count() > 0
                || !rank_supports(dictionary.values().data_type())
            {
                return Ok(None);
            }
            values.push(dictionary.values().clone());
        }
        let all = concat(&values.iter().map(|v| v.as_ref()).collect::<Vec<_>>())?;
        let options = SortOptions {
            descending: key.descending,
            nulls_first: false,
        };
        // Equal values share a rank (with gaps after them): make them dense.
        let ranks = rank(all.as_ref(), Some(options))?;
        let mut distinct = ranks.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let dense = |r: u32| distinct.binary_search(&r).expect("a rank of these values") as u64;
        let mut tables = Vec::with_capacity(values.len());
        let mut at = 0;
        for v in &values {
            tables.push(ranks[at..at + v.len()].iter().map(|&r| dense(r)).collect());
            at += v.len();
        }
        // One value of each digit: the first of all the values ranked so.
        let mut first = vec![u32::MAX; distinct.len()];
        for (i, &r) in ranks.iter().enumerate() {
            let d = dense(r) as usize;
            if first[d] == u32::MAX {
                first[d] = i as u32;
            }
        }
        let values = take(all.as_ref(), &UInt32Array::from(first), None)?;
        Ok(Some(Digits {
            tables,
            radix: distinct.len() as u64,
            values,
        }))
    }
}

/// Whether arrow's `rank` ranks values of this type.
fn rank_supports(t: &DataType) -> bool {
    t.is_primitive()
        || matches!(
            t,
            DataType::Boolean
                | DataType::Utf8
                | DataType::LargeUtf8
                | DataType::Binary
                | DataType::LargeBinary
        )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::{Field, Int8Type, Schema};
    use proptest::prelude::*;

    use super::*;

    fn schema() -> SchemaRef {
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        Arc::new(Schema::new(vec![
            Field::new("a", dict.clone(), true),
            Field::new("b", dict, true),
            Field::new("v", DataType::Int64, false),
        ]))
    }

    /// A batch whose key columns use the given dictionaries (values in
    /// the given order, duplicates allowed) and pick `rows[i].0/.1` from
    /// them; `v` numbers the rows from `first`.
    fn batch(da: &[&str], db: &[&str], rows: &[(i8, i8)], first: i64) -> RecordBatch {
        let a = DictionaryArray::<Int8Type>::try_new(
            rows.iter().map(|r| r.0).collect(),
            Arc::new(StringArray::from(da.to_vec())),
        )
        .unwrap();
        let b = DictionaryArray::<Int8Type>::try_new(
            rows.iter().map(|r| r.1).collect(),
            Arc::new(StringArray::from(db.to_vec())),
        )
        .unwrap();
        let v = Int64Array::from_iter_values(first..first + rows.len() as i64);
        RecordBatch::try_new(schema(), vec![Arc::new(a), Arc::new(b), Arc::new(v)]).unwrap()
    }

    /// Each row as (a, b, v) strings and number.
    fn rows_of(batches: &[RecordBatch]) -> Vec<(String, String, i64)> {
        let mut out = Vec::new();
        for b in batches {
            let a = cast(b.column(0), &DataType::Utf8).unwrap();
            let bb = cast(b.column(1), &DataType::Utf8).unwrap();
            let v = b.column(2).as_primitive::<arrow::datatypes::Int64Type>();
            for i in 0..b.num_rows() {
                out.push((
                    a.as_string::<i32>().value(i).to_string(),
                    bb.as_string::<i32>().value(i).to_string(),
                    v.value(i),
                ));
            }
        }
        out
    }

    /// Checks `sorted` is a permutation of `input`'s rows, in the keys'
    /// lexicographic order of the *values* (not of the dictionary keys).
    fn check_sorted(input: &[RecordBatch], sorted: &[RecordBatch], keys: &[Key]) {
        let got = rows_of(sorted);
        let mut want = rows_of(input);
        let mut have = got.clone();
        want.sort();
        have.sort();
        assert_eq!(have, want, "not a permutation of the input");
        let field =
            |r: &(String, String, i64), c: usize| if c == 0 { r.0.clone() } else { r.1.clone() };
        for w in got.windows(2) {
            for k in keys {
                let (x, y) = (field(&w[0], k.column), field(&w[1], k.column));
                let ord = if k.descending { y.cmp(&x) } else { x.cmp(&y) };
                match ord {
                    std::cmp::Ordering::Less => break,
                    std::cmp::Ordering::Equal => continue,
                    std::cmp::Ordering::Greater => panic!("{:?} before {:?}", w[0], w[1]),
                }
            }
        }
    }

    const ASC_ASC: [Key; 2] = [
        Key {
            column: 0,
            descending: false,
        },
        Key {
            column: 1,
            descending: false,
        },
    ];

    #[test]
    fn batches_with_different_dictionaries_sort_by_value() {
        // The same letters under different keys in each batch, one with a
        // value twice: ranks must be of values, across batches.
        let input = vec![
            batch(
                &["R", "A", "N"],
                &["O", "F"],
                &[(0, 0), (1, 1), (2, 0), (1, 0)],
                0,
            ),
            batch(
                &["N", "A", "A"],
                &["F", "O"],
                &[(0, 1), (2, 0), (1, 1), (0, 0)],
                4,
            ),
            batch(&["A"], &["O"], &[(0, 0)], 8),
        ];
        let sorted = sort(&schema(), &input, &ASC_ASC, 3)
            .unwrap()
            .expect("dictionary keys qualify");
        assert!(sorted.iter().all(|b| b.num_rows() <= 3));
        assert_eq!(sorted.iter().map(|b| b.num_rows()).sum::<usize>(), 9);
        check_sorted(&input, &sorted, &ASC_ASC);
    }

    #[test]
    fn descending_keys_reverse_their_digit_only() {
        let input = vec![batch(
            &["A", "N", "R"],
            &["F", "O"],
            &[(0, 0), (0, 1), (1, 0), (2, 1), (2, 0), (1, 1)],
            0,
        )];
        for keys in [
            [
                Key {
                    column: 0,
                    descending: true,
                },
                Key {
                    column: 1,
                    descending: false,
                },
            ],
            [
                Key {
                    column: 0,
                    descending: false,
                },
                Key {
                    column: 1,
                    descending: true,
                },
            ],
            [
                Key {
                    column: 1,
                    descending: true,
                },
                Key {
                    column: 0,
                    descending: true,
                },
            ],
        ] {
            let sorted = sort(&schema(), &input, &keys, 1024).unwrap().unwrap();
            check_sorted(&input, &sorted, &keys);
        }
    }

    #[test]
    fn keys_that_do_not_qualify_are_declined() {
        let input = vec![batch(&["A", "N"], &["F", "O"], &[(0, 0), (1, 1)], 0)];
        // Not a dictionary column.
        let on_v = [Key {
            column: 2,
            descending: false,
        }];
        assert!(sort(&schema(), &input, &on_v, 16).unwrap().is_none());
        assert!(sort(&schema(), &input, &[], 16).unwrap().is_none());
        // A null row in a key column.
        let a = DictionaryArray::<Int8Type>::try_new(
            vec![Some(0), None].into(),
            Arc::new(StringArray::from(vec!["A"])),
        )
        .unwrap();
        let with_null = RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(a),
                input[0].column(1).clone(),
                input[0].column(2).clone(),
            ],
        )
        .unwrap();
        assert!(
            sort(&schema(), &[with_null], &ASC_ASC, 16)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn no_rows_sort_to_no_batches() {
        assert_eq!(
            sort(&schema(), &[], &ASC_ASC, 16).unwrap().unwrap().len(),
            0
        );
        let empty = vec![batch(&["A"], &["F"], &[], 0)];
        assert_eq!(
            sort(&schema(), &empty, &ASC_ASC, 16)
                .unwrap()
                .unwrap()
                .len(),
            0
        );
    }

    #[test]
    fn more_key_values_than_buckets_sort_by_sorting_the_normalized_key() {
        // 100 x 2 normalized values: past MAX_BUCKETS, so sort_to_indices.
        let names: Vec<String> = (0..100).map(|i| format!("k{i:03}")).collect();
        let da: Vec<&str> = names.iter().rev().map(String::as_str).collect();
        let rows: Vec<(i8, i8)> = (0..400)
            .map(|i| ((i * 37 % 100) as i8, (i % 2) as i8))
            .collect();
        let input = [batch(&da, &["y", "x"], &rows, 0)];
        let keys = [
            Key {
                column: 0,
                descending: false,
            },
            Key {
                column: 1,
                descending: true,
            },
        ];
        const { assert!(100 * 2 > MAX_BUCKETS) };
        let sorted = sort(&schema(), &input, &keys, 64).unwrap().unwrap();
        check_sorted(&input, &sorted, &keys);
    }

    #[test]
    fn bucketed_key_columns_keep_their_dictionary_type() {
        let input = [
            batch(&["N", "A"], &["O", "F"], &[(0, 0), (1, 1), (0, 1)], 0),
            batch(&["R", "A"], &["F"], &[(0, 0), (1, 0)], 3),
        ];
        let sorted = sort(&schema(), &input, &ASC_ASC, 2).unwrap().unwrap();
        for b in &sorted {
            assert_eq!(b.schema(), schema());
        }
        check_sorted(&input, &sorted, &ASC_ASC);
    }

    #[test]
    fn columns_with_nulls_or_of_variable_width_move_with_their_rows() {
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", dict.clone(), false),
            Field::new("b", dict, false),
            Field::new("v", DataType::Int64, false),
            Field::new("n", DataType::Int64, true),
            Field::new("s", DataType::Utf8, false),
        ]));
        let input: Vec<RecordBatch> = (0..3)
            .map(|i| {
                let keyed = batch(
                    &["R", "A", "N"],
                    &["O", "F"],
                    &[(0, 0), (1, 1), (2, 0), (1, 0)],
                    i * 4,
                );
                let v = keyed
                    .column(2)
                    .as_primitive::<arrow::datatypes::Int64Type>();
                let n: Int64Array = v.iter().map(|x| x.filter(|x| x % 3 != 0)).collect();
                let s: StringArray = v.iter().map(|x| x.map(|x| format!("row {x}"))).collect();
                let mut cols = keyed.columns().to_vec();
                cols.push(Arc::new(n));
                cols.push(Arc::new(s));
                RecordBatch::try_new(schema.clone(), cols).unwrap()
            })
            .collect();
        let sorted = sort(&schema, &input, &ASC_ASC, 5).unwrap().unwrap();
        let keyed: Vec<RecordBatch> = sorted
            .iter()
            .map(|b| b.project(&[0, 1, 2]).unwrap())
            .collect();
        let original: Vec<RecordBatch> = input
            .iter()
            .map(|b| b.project(&[0, 1, 2]).unwrap())
            .collect();
        check_sorted(&original, &keyed, &ASC_ASC);
        for b in &sorted {
            let v = b.column(2).as_primitive::<arrow::datatypes::Int64Type>();
            let n = b.column(3).as_primitive::<arrow::datatypes::Int64Type>();
            let s = b.column(4).as_string::<i32>();
            for r in 0..b.num_rows() {
                let x = v.value(r);
                assert_eq!(n.is_null(r), x % 3 == 0, "row {x}: its null moved with it");
                if !n.is_null(r) {
                    assert_eq!(n.value(r), x);
                }
                assert_eq!(s.value(r), format!("row {x}"));
            }
        }
    }

    proptest! {
        #[test]
        fn any_dictionaries_and_rows_sort_like_their_values(
            blocks in proptest::collection::vec(
                (
                    proptest::collection::vec("[A-D]{0,2}", 1..5),
                    proptest::collection::vec("[x-z]", 1..4),
                    proptest::collection::vec((0usize..100, 0usize..100), 0..40),
                ),
                0..6,
            ),
            desc_a in any::<bool>(),
            desc_b in any::<bool>(),
            b_first in any::<bool>(),
            batch_rows in 1usize..50,
        ) {
            let mut first = 0;
            let input: Vec<RecordBatch> = blocks
                .iter()
                .map(|(da, db, rows)| {
                    let da: Vec<&str> = da.iter().map(String::as_str).collect();
                    let db: Vec<&str> = db.iter().map(String::as_str).collect();
                    let rows: Vec<(i8, i8)> = rows
                        .iter()
                        .map(|&(x, y)| ((x % da.len()) as i8, (y % db.len()) as i8))
                        .collect();
                    let b = batch(&da, &db, &rows, first);
                    first += rows.len() as i64;
                    b
                })
                .collect();
            let ka = Key { column: 0, descending: desc_a };
            let kb = Key { column: 1, descending: desc_b };
            let keys = if b_first { [kb, ka] } else { [ka, kb] };
            let sorted = sort(&schema(), &input, &keys, batch_rows).unwrap().unwrap();
            prop_assert!(sorted.iter().all(|b| b.num_rows() <= batch_rows && b.num_rows() > 0));
            check_sorted(&input, &sorted, &keys);
        }
    }
}
