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
//! bucketed, a stable counting order built from arrow kernels: for each
//! value in turn, `eq` marks its rows and `filter` keeps their indices, and
//! the buckets are concatenated (6 ms where `sort_to_indices` took 20 at
//! 1.5 million rows). The bucket sizes then give the sorted key columns
//! without gathering them: bucket `v` holds the rows whose key `i` has
//! digit `(v / weight_i) % d_i`, so each key column is a run of that digit
//! per bucket over one dictionary of the ranked values, and only the other
//! columns are concatenated and gathered (the concatenation of the key
//! columns merged 92 dictionaries, most of the cost of `concat_batches`).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, DictionaryArray, UInt32Array, UInt64Array};
use arrow::compute::kernels::cmp::eq;
use arrow::compute::{
    SortOptions, cast, concat, concat_batches, filter, rank, sort_to_indices, take,
    take_record_batch,
};
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
    let Some(Normalized {
        keys: normalized,
        radix,
        weights,
    }) = normalize(batches, keys, rows)?
    else {
        return Ok(None);
    };
    let sorted = if radix <= MAX_BUCKETS {
        by_buckets(schema, batches, normalized, radix, &weights)?
    } else {
        let order = sort_to_indices(&UInt64Array::from(normalized), None, None)?;
        take_record_batch(&concat_batches(schema, batches)?, &order)?
    };
    Ok(Some(
        (0..rows)
            .step_by(batch_rows)
            .map(|start| sorted.slice(start, batch_rows.min(rows - start)))
            .collect(),
    ))
}

/// Every row's normalized key, with what rebuilds the key columns from it.
struct Normalized {
    /// Row `r`'s normalized key, rows in input order.
    keys: Vec<u64>,
    /// Every normalized key is below this: the product of the keys' radixes.
    radix: u64,
    /// (key, its weight, its digits), least significant key first.
    weights: Vec<(Key, u64, Digits)>,
}

/// The normalized key of each of the `rows` rows of `batches`; `None` when
/// a key does not qualify or the radix product does not fit 64 bits.
fn normalize(batches: &[RecordBatch], keys: &[Key], rows: usize) -> Result<Option<Normalized>> {
    let mut normalized = vec![0u64; rows];
    let mut radix: u64 = 1;
    // (key, its weight, its digits), for rebuilding the key columns.
    let mut weights: Vec<(Key, u64, Digits)> = Vec::with_capacity(keys.len());
    // Least significant key first, so each key's weight is the product of
    // the radixes after it.
    for key in keys.iter().rev() {
        let Some(digits) = Digits::of(batches, *key)? else {
            return Ok(None);
        };
        let Some(next_radix) = radix.checked_mul(digits.radix) else {
            return Ok(None);
        };
        let mut row = 0;
        for (batch, table) in batches.iter().zip(&digits.tables) {
            let column = batch.column(key.column).as_any_dictionary();
            let dictionary_keys = cast(column.keys(), &DataType::UInt32)?;
            for &k in dictionary_keys.as_primitive::<UInt32Type>().values() {
                normalized[row] += table[k as usize] * radix;
                row += 1;
            }
        }
        debug_assert_eq!(row, rows);
        weights.push((*key, radix, digits));
        radix = next_radix;
    }
    Ok(Some(Normalized {
        keys: normalized,
        radix,
        weights,
    }))
}

/// The rows in order of their normalized key (below `radix`, at most
/// [`MAX_BUCKETS`]) as one batch: bucketed, the key columns rebuilt from
/// the buckets, only the other columns gathered.
fn by_buckets(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    normalized: Vec<u64>,
    radix: u64,
    weights: &[(Key, u64, Digits)],
) -> Result<RecordBatch> {
    let rows = normalized.len();
    let (order, buckets) = bucket_order(UInt64Array::from(normalized), radix)?;
    // The key columns follow from the buckets: bucket `v` holds the
    // rows whose key `i` has the value of digit `(v / weight_i) %
    // radix_i`. Only the other columns are gathered.
    let mut columns: Vec<Option<ArrayRef>> = vec![None; schema.fields().len()];
    for (key, weight, digits) in weights {
        let mut codes: Vec<u32> = Vec::with_capacity(rows);
        for &(value, count) in &buckets {
            let digit = (value / weight) % digits.radix;
            codes.extend(std::iter::repeat_n(digit as u32, count));
        }
        let column = DictionaryArray::<UInt32Type>::try_new(
            UInt32Array::from(codes),
            digits.values.clone(),
        )?;
        columns[key.column] = Some(cast(&column, schema.field(key.column).data_type())?);
    }
    let rest: Vec<usize> = (0..columns.len())
        .filter(|&c| columns[c].is_none())
        .collect();
    if !rest.is_empty() {
        let projected = batches
            .iter()
            .map(|b| b.project(&rest))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let gathered = take_record_batch(
            &concat_batches(&Arc::new(schema.project(&rest)?), &projected)?,
            &order,
        )?;
        for (from, &to) in rest.iter().enumerate() {
            columns[to] = Some(gathered.column(from).clone());
        }
    }
    Ok(RecordBatch::try_new(
        schema.clone(),
        columns
            .into_iter()
            .map(|c| c.expect("every column rebuilt or gathered"))
            .collect(),
    )?)
}

/// Normalized keys with at most this many distinct values are ordered by
/// bucket (one `eq` and one `filter` pass per value) instead of sorted.
pub const MAX_BUCKETS: u64 = 64;

/// The row order of `normalized` (values below `radix`), stable: for each
/// value in turn, the indices of its rows in input order (arrow's `eq`,
/// then `filter` of the row indices), concatenated.
/// Also returns each non-empty bucket's value and row count, in order.
fn bucket_order(normalized: UInt64Array, radix: u64) -> Result<(UInt32Array, Vec<(u64, usize)>)> {
    let rows = UInt32Array::from_iter_values(0..normalized.len() as u32);
    let mut buckets: Vec<ArrayRef> = Vec::with_capacity(radix as usize);
    let mut counts = Vec::with_capacity(radix as usize);
    for value in 0..radix {
        let mask = eq(&normalized, &UInt64Array::new_scalar(value))?;
        let count = mask.true_count();
        if count > 0 {
            buckets.push(filter(&rows, &mask)?);
            counts.push((value, count));
        }
    }
    let order = concat(&buckets.iter().map(|b| b.as_ref()).collect::<Vec<_>>())?;
    assert_eq!(order.len(), normalized.len(), "every row in one bucket");
    Ok((order.as_primitive::<UInt32Type>().clone(), counts))
}

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
