//! Group-by over sorted input, by runs: the Group-by of the AggGrpSort
//! bundle after Q1's Sort.
//!
//! Section 4.2 of the smart-storage paper runs Q1 as Scan, then Sort, then
//! the bundle Group-by + Aggregate + LocalSort: the Group-by's input is
//! already ordered by the group keys, so each group is one run of adjacent
//! rows and grouping needs no hashing of the keys. DataFusion's
//! `AggregateExec` does not know that a stored object is sorted and hashes
//! every row's keys (two dictionary-encoded columns for Q1: arrow-row
//! encodes both dictionaries' values for each of a node's 1.5 million rows,
//! about half of the bundle's time).
//!
//! [`group_ids`] finds the runs of equal keys in each batch with arrow's
//! `partition` kernel (over a dictionary column's keys, which are equal
//! wherever the values are), gives each run the id of its key values (runs
//! whose keys are equal share an id, so input that is not sorted, or sorted
//! runs split across batches, still group correctly), and returns one
//! dense `UInt32` id per row. The caller then lets DataFusion aggregate by
//! that single primitive column (its fast primitive group values) and takes
//! the key values back by id.
//!
//! When the runs are short, that is when the input is not clustered by its
//! keys (an aggregation reading a deferred Sort's input unsorted, see
//! [`crate::ops::bounded::ignores_order`]), and every key is a small
//! dictionary without nulls (Q1's flags), the ids come from the
//! dictionary keys instead ([`ids_by_codes`]): a row's keys combine into
//! one small integer code, looked up in a table. Otherwise [`group_ids`]
//! declines (returns `None`, and the caller hashes the keys as before).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, UInt32Array};
use arrow::compute::{interleave, partition};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, SortField};

use crate::error::Result;

/// Runs shorter than this many rows on average mean the input is not
/// clustered by its keys: [`group_ids`] then takes the dictionary codes
/// ([`ids_by_codes`]) or declines.
pub const MIN_MEAN_RUN: usize = 8;

/// [`group_ids`] judges the runs once it has seen this many rows (or all
/// of them), so a short first slice does not decide for the whole input.
const JUDGE_AFTER: usize = 4096;

/// Dense group ids for every row, and each group's key values.
#[derive(Debug)]
pub struct GroupIds {
    /// One id column per input batch, ids `0 .. groups`.
    pub ids: Vec<ArrayRef>,
    /// The key columns, one row per group, row `g` the keys of group `g`.
    pub keys: Vec<ArrayRef>,
}

impl GroupIds {
    /// Number of distinct groups.
    pub fn groups(&self) -> usize {
        self.keys.first().map_or(0, |k| k.len())
    }
}

/// Assigns group ids to the rows of `batches` by the runs of equal values
/// of the columns `keys`, or, when the runs are short, by the keys'
/// dictionary codes ([`ids_by_codes`]); `None` when there are no rows, no
/// keys, or the runs are short and the keys not small dictionaries (see
/// the module documentation).
pub fn group_ids(batches: &[RecordBatch], keys: &[usize]) -> Result<Option<GroupIds>> {
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    if keys.is_empty() || rows == 0 || rows > u32::MAX as usize {
        return Ok(None);
    }
    let fields: Vec<SortField> = keys
        .iter()
        .map(|&k| SortField::new(batches[0].schema().field(k).data_type().clone()))
        .collect();
    let converter = RowConverter::new(fields)?;
    let (mut runs, mut seen) = (0usize, 0usize);
    let mut groups = Numbering::new(batches.len());
    for (b, batch) in batches.iter().enumerate() {
        if batch.num_rows() == 0 {
            groups.push(Vec::new());
            continue;
        }
        // A dictionary column's runs are the runs of its keys: equal keys
        // are equal values (equal values under different keys only split a
        // run, and the split runs get the same id below).
        let compared: Vec<ArrayRef> = keys
            .iter()
            .map(|&k| {
                let c = batch.column(k);
                match c.as_any_dictionary_opt() {
                    Some(d) => d.keys().slice(0, d.keys().len()),
                    None => c.clone(),
                }
            })
            .collect();
        let ranges = partition(&compared)?.ranges();
        runs += ranges.len();
        seen += batch.num_rows();
        // Judged by the rows so far, so unclustered input is found early.
        if runs > (seen / MIN_MEAN_RUN).max(1) && (seen >= JUDGE_AFTER || b + 1 == batches.len()) {
            return ids_by_codes(batches, keys, &converter);
        }
        let starts = UInt32Array::from_iter_values(ranges.iter().map(|r| r.start as u32));
        let heads: Vec<ArrayRef> = keys
            .iter()
            .map(|&k| arrow::compute::take(batch.column(k), &starts, None))
            .collect::<std::result::Result<_, _>>()?;
        let encoded = converter.convert_columns(&heads)?;
        let mut column = Vec::with_capacity(batch.num_rows());
        for (run, range) in ranges.iter().enumerate() {
            let id = groups.id(encoded.row(run).as_ref(), (b, range.start));
            column.extend(std::iter::repeat_n(id, range.len()));
        }
        debug_assert_eq!(column.len(), batch.num_rows());
        groups.push(column);
    }
    groups.finish(batches, keys).map(Some)
}

/// Most combinations of dictionary keys [`ids_by_codes`] tabulates for
/// one batch (the product of its key columns' dictionary sizes).
pub const MAX_CODES: usize = 1 << 16;

/// Group ids for input not clustered by its keys, when every key column
/// is dictionary-encoded without nulls and their dictionaries are small
/// (Q1's flags, read in the order they are stored): a row's keys in its
/// batch's dictionaries combine into one code (`key_0 + key_1 * size_0 +
/// ...`), and a table from code to id, filled the first time each code
/// appears, gives the row its id. Only a code's first row is encoded
/// (arrow's row format) to find the id its key values already have, so
/// equal values under different dictionaries, or twice in one, share a
/// group. `None` when a key is not a dictionary, has nulls, or the
/// dictionaries hold more than [`MAX_CODES`] combinations.
fn ids_by_codes(
    batches: &[RecordBatch],
    keys: &[usize],
    converter: &RowConverter,
) -> Result<Option<GroupIds>> {
    let mut groups = Numbering::new(batches.len());
    for (b, batch) in batches.iter().enumerate() {
        if batch.num_rows() == 0 {
            // (Its dictionaries may be empty: nothing to look up.)
            groups.push(Vec::new());
            continue;
        }
        let mut codes = vec![0usize; batch.num_rows()];
        let mut combinations = 1usize;
        for &k in keys {
            let column = batch.column(k);
            let Some(dict) = column.as_any_dictionary_opt() else {
                return Ok(None);
            };
            if column.logical_null_count() > 0 {
                return Ok(None);
            }
            for (code, key) in codes.iter_mut().zip(dict.normalized_keys()) {
                *code += key * combinations;
            }
            combinations = match combinations.checked_mul(dict.values().len()) {
                Some(c) if c <= MAX_CODES => c,
                _ => return Ok(None),
            };
        }
        let mut id_of_code = vec![u32::MAX; combinations];
        let mut column = Vec::with_capacity(batch.num_rows());
        for (row, &code) in codes.iter().enumerate() {
            let mut id = id_of_code[code];
            if id == u32::MAX {
                let heads: Vec<ArrayRef> = keys
                    .iter()
                    .map(|&k| batch.column(k).slice(row, 1))
                    .collect();
                let encoded = converter.convert_columns(&heads)?;
                id = groups.id(encoded.row(0).as_ref(), (b, row));
                id_of_code[code] = id;
            }
            column.push(id);
        }
        groups.push(column);
    }
    if groups.first.is_empty() {
        return Ok(None);
    }
    groups.finish(batches, keys).map(Some)
}

/// Dense group ids handed out as key values are first met, by the key
/// values' row encoding; and each batch's id column.
struct Numbering {
    id_of: HashMap<Box<[u8]>, u32>,
    /// (batch, row) of each group's first row, in id order.
    first: Vec<(usize, usize)>,
    ids: Vec<ArrayRef>,
}

impl Numbering {
    fn new(batches: usize) -> Numbering {
        Numbering {
            id_of: HashMap::new(),
            first: Vec::new(),
            ids: Vec::with_capacity(batches),
        }
    }

    /// The id of the group whose encoded keys are `key`, met at `at`
    /// (batch, row): a new one if they are new.
    fn id(&mut self, key: &[u8], at: (usize, usize)) -> u32 {
        let next = self.first.len() as u32;
        *self.id_of.entry(key.into()).or_insert_with(|| {
            self.first.push(at);
            next
        })
    }

    /// The next batch's ids.
    fn push(&mut self, column: Vec<u32>) {
        self.ids
            .push(Arc::new(UInt32Array::from(column)) as ArrayRef);
    }

    /// The rows' ids, with the groups' key values taken from each group's
    /// first row.
    fn finish(self, batches: &[RecordBatch], keys: &[usize]) -> Result<GroupIds> {
        let keys = keys
            .iter()
            .map(|&k| {
                let columns: Vec<&dyn Array> =
                    batches.iter().map(|b| b.column(k).as_ref()).collect();
                interleave(&columns, &self.first)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(GroupIds {
            ids: self.ids,
            keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Int8Type, Schema};

    fn batch(flags: &[&str], values: &[i64], dict: &[&str]) -> RecordBatch {
        let keys: Vec<i8> = flags
            .iter()
            .map(|f| dict.iter().position(|d| d == f).unwrap() as i8)
            .collect();
        let flag = DictionaryArray::<Int8Type>::try_new(
            keys.into(),
            Arc::new(StringArray::from(dict.to_vec())),
        )
        .unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "f",
                DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
                false,
            ),
            Field::new("v", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![Arc::new(flag), Arc::new(Int64Array::from(values.to_vec()))],
        )
        .unwrap()
    }

    fn ids(g: &GroupIds) -> Vec<Vec<u32>> {
        g.ids
            .iter()
            .map(|a| {
                a.as_primitive::<arrow::datatypes::UInt32Type>()
                    .values()
                    .to_vec()
            })
            .collect()
    }

    fn key_strings(g: &GroupIds) -> Vec<String> {
        let k = arrow::compute::cast(&g.keys[0], &DataType::Utf8).unwrap();
        k.as_string::<i32>()
            .iter()
            .map(|s| s.unwrap().to_string())
            .collect()
    }

    #[test]
    fn equal_values_under_different_dictionaries_share_one_group() {
        let a = batch(&["A"; 8], &[1; 8], &["A", "N"]);
        let b = batch(&["A"; 8], &[2; 8], &["N", "A"]);
        let c = batch(&["N"; 8], &[3; 8], &["N", "A"]);
        let g = group_ids(&[a, b, c], &[0]).unwrap().unwrap();
        assert_eq!(g.groups(), 2);
        assert_eq!(ids(&g), vec![vec![0; 8], vec![0; 8], vec![1; 8]]);
        assert_eq!(key_strings(&g), ["A", "N"]);
    }

    #[test]
    fn a_repeated_value_in_one_dictionary_splits_a_run_but_not_its_group() {
        // Keys 0 and 1 both mean "A".
        let mut flags = vec!["A"; 16];
        flags.extend(["B"; 16]);
        let b = batch(&flags, &[0; 32], &["A", "B"]);
        let (schema, cols) = (b.schema(), b.columns().to_vec());
        let dict = cols[0].as_any_dictionary();
        let mut keys: Vec<i8> = dict
            .keys()
            .as_primitive::<Int8Type>()
            .values()
            .iter()
            .copied()
            .collect();
        for k in keys.iter_mut().take(4) {
            *k = 2;
        }
        let flag = DictionaryArray::<Int8Type>::try_new(
            keys.into(),
            Arc::new(StringArray::from(vec!["A", "B", "A"])),
        )
        .unwrap();
        let b = RecordBatch::try_new(schema, vec![Arc::new(flag), cols[1].clone()]).unwrap();
        let g = group_ids(&[b], &[0]).unwrap().unwrap();
        assert_eq!(g.groups(), 2);
        let mut want = vec![0; 16];
        want.extend([1; 16]);
        assert_eq!(ids(&g), vec![want]);
    }

    #[test]
    fn unclustered_dictionary_keys_are_grouped_by_their_codes_across_dictionaries() {
        let flags: Vec<&str> = (0..64).map(|i| ["A", "N"][i % 2]).collect();
        let a = batch(&flags, &[0; 64], &["A", "N"]);
        // The same values under the other order of keys, and a dictionary
        // naming "A" twice.
        let b = batch(&flags, &[0; 64], &["N", "A"]);
        let c = {
            let d = DictionaryArray::<Int8Type>::try_new(
                (0..64)
                    .map(|i| [0i8, 2, 1][i % 3])
                    .collect::<Vec<_>>()
                    .into(),
                Arc::new(StringArray::from(vec!["A", "N", "A"])),
            )
            .unwrap();
            RecordBatch::try_new(
                a.schema(),
                vec![Arc::new(d), Arc::new(Int64Array::from(vec![0i64; 64]))],
            )
            .unwrap()
        };
        // An empty batch, its dictionary empty too, among them.
        let empty = RecordBatch::new_empty(a.schema());
        let g = group_ids(&[a, empty, b, c], &[0]).unwrap().unwrap();
        assert_eq!(g.groups(), 2);
        assert_eq!(key_strings(&g), ["A", "N"]);
        let alternating: Vec<u32> = (0..64).map(|i| (i % 2) as u32).collect();
        let third: Vec<u32> = (0..64).map(|i| [0, 0, 1][i % 3]).collect();
        assert_eq!(
            ids(&g),
            vec![alternating.clone(), Vec::new(), alternating, third]
        );
    }

    #[test]
    fn unclustered_keys_that_are_not_small_dictionaries_are_declined() {
        let plain = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let b = RecordBatch::try_new(
            plain,
            vec![Arc::new(Int64Array::from_iter_values(
                (0..64).map(|i| i % 2),
            ))],
        )
        .unwrap();
        assert!(group_ids(&[b], &[0]).unwrap().is_none());
        // A dictionary with a null key.
        let d = DictionaryArray::<Int8Type>::try_new(
            (0..64)
                .map(|i| (i % 3 != 0).then_some((i % 2) as i8))
                .collect::<arrow::array::Int8Array>(),
            Arc::new(StringArray::from(vec!["A", "N"])),
        )
        .unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new(
            "f",
            DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
            true,
        )]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(d)]).unwrap();
        assert!(group_ids(&[b], &[0]).unwrap().is_none());
    }

    #[test]
    fn no_rows_or_no_keys_are_declined() {
        let b = batch(&["A"; 8], &[0; 8], &["A"]);
        assert!(group_ids(&[], &[0]).unwrap().is_none());
        assert!(group_ids(std::slice::from_ref(&b), &[]).unwrap().is_none());
        assert!(group_ids(&[b.slice(0, 0)], &[0]).unwrap().is_none());
    }
}
