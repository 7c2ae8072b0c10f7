//! A record batch's own bytes, as opposed to the buffers it slices.
//!
//! Arrays decoded zero-copy from one stored column segment or one Flight
//! message all slice that shared buffer, and arrow's
//! `get_array_memory_size` counts the whole buffer once per array. A node
//! sizes what it holds against its on-device memory (the paper's 64 MB,
//! section 5) and what it encodes by the rows' own bytes
//! ([`data_bytes`]); before a batch crosses Flight it drops the shared
//! buffers ([`compact`]), so the receiver sees the sender's row blocks
//! unsplit, which the redundancy layouts of section 3 need to rebuild a
//! lost partition bit-exact.

use arrow::array::{ArrayData, MutableArrayData, make_array};
use arrow::datatypes::DataType;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;

/// Bytes of data a batch holds (its arrays' slices; arrays decoded from
/// one message share its buffer, which `get_array_memory_size` would count
/// once per array).
pub fn data_bytes(b: &RecordBatch) -> usize {
    b.columns()
        .iter()
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum()
}

/// `b` with arrays that hold only their own rows' bytes. An array decoded
/// zero-copy from a stored column segment slices that whole segment, and
/// Flight's encoder sizes a batch by its buffers' capacity: it would split
/// a 16,384-row block into many messages, and the receiver would no longer
/// see the sender's row blocks.
pub fn compact(b: RecordBatch) -> Result<RecordBatch, ArrowError> {
    if b.get_array_memory_size() <= 2 * data_bytes(&b) + 4096 {
        return Ok(b);
    }
    let cols = b
        .columns()
        .iter()
        .map(|c| Ok(make_array(compact_data(&c.to_data())?)))
        .collect::<Result<Vec<_>, ArrowError>>()?;
    RecordBatch::try_new(b.schema(), cols)
}

/// A copy of `d` holding only its own rows. A dictionary's values are
/// copied too (they may slice a shared buffer as well), in the same order,
/// so the copy encodes to the same bytes.
fn compact_data(d: &ArrayData) -> Result<ArrayData, ArrowError> {
    if let DataType::Dictionary(key, _) = d.data_type() {
        let keys = ArrayData::builder(key.as_ref().clone())
            .len(d.len())
            .offset(d.offset())
            .nulls(d.nulls().cloned())
            .buffers(d.buffers().to_vec())
            .build()?;
        let values = compact_data(&d.child_data()[0])?;
        return compact_data(&keys)?
            .into_builder()
            .data_type(d.data_type().clone())
            .child_data(vec![values])
            .build();
    }
    let mut m = MutableArrayData::new(vec![d], false, d.len());
    m.try_extend(0, 0, d.len())?;
    Ok(m.freeze())
}
