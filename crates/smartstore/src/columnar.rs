//! A table object's payload: one Arrow IPC stream per column, so a
//! primitive reads only the columns it needs off the device.
//!
//! The main group partitions a table row-wise (section 3.1 of the
//! smart-storage paper: each node holds whole rows, row blocks 1-5-9-13);
//! inside a node the rows of a partition are stored column by column. Q1's
//! Scan needs 6 of `lineitem`'s 16 columns: it reads, checks and decodes
//! those 6 segments and nothing else. Each segment carries its own
//! checksum, so a projected read still never returns damaged data; the
//! object's whole-payload checksum (see [`crate::object`]) covers the whole
//! file when it is shipped or rebuilt.
//!
//! ## Payload format
//!
//! ```text
//! offset   size    field
//!      0      4    segment count n (u32, little-endian) = columns + 1
//!      4      4    crc32c of the directory (bytes 8 .. 8 + 24 n)
//!      8   24 n    directory, one entry per segment:
//!                    offset (u64) from the payload's start, 64-aligned
//!                    length (u64)
//!                    crc32c of the segment (u32)
//!                    reserved, zero (u32)
//!    ...           segments, each starting at its offset; zero padding
//!                  between them
//! ```
//!
//! Segment 0 is an Arrow IPC stream holding only the table's schema;
//! segment `1 + i` is an IPC stream of column `i` alone, one record batch
//! per row block, every column with the same batch lengths. Encoding is
//! deterministic (the same batches give the same bytes), which the
//! redundancy layouts need to rebuild a lost node's file bit-exact.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::ArrayRef;
use arrow::buffer::{Buffer, MutableBuffer};
use arrow::datatypes::{Schema, SchemaRef};
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::IpcWriteOptions;
use arrow::record_batch::RecordBatch;

use crate::batch::data_bytes;
use crate::codec::{self, Codec};
use crate::error::{Error, Result};
use crate::object;

mod stream;
mod writer;
pub use stream::{READ_CHUNK, RowBlocks};
pub use writer::TableWriter;

/// Bytes of one directory entry.
const ENTRY_LEN: usize = 24;
/// Bytes before the directory.
const PREFIX_LEN: usize = 8;
/// Segments start at multiples of this (Arrow's buffer alignment).
const ALIGN: usize = 64;
/// Most segments a payload may declare (a table of 65,535 columns).
const MAX_SEGMENTS: usize = 1 << 16;

/// One directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    offset: u64,
    len: u64,
    crc: u32,
}

/// Encodes `batches` (all with `schema`) as a columnar table payload.
pub fn encode(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_into(&mut out, schema, batches, Codec::Plain)?;
    Ok(out)
}

/// A complete table object file ([`object`]'s header around the columnar
/// payload of `batches`), encoded in place.
pub fn table_file(schema: &SchemaRef, batches: &[RecordBatch]) -> Result<Vec<u8>> {
    table_file_with(schema, batches, Codec::Plain)
}

/// [`table_file`] with the columns encoded by `codec` (see
/// [`crate::codec`]): how checkpoints are stored and shipped.
pub fn table_file_with(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    codec: Codec,
) -> Result<Vec<u8>> {
    object::build(object::Kind::Table, |file| {
        encode_into(file, schema, batches, codec)
    })
}

/// Appends the columnar payload of `batches` to `out` (offsets count from
/// where it starts), its columns encoded by `codec`. Each segment is
/// encoded in place, so the payload is written once (no per-column buffers
/// copied after).
pub fn encode_into(
    out: &mut Vec<u8>,
    schema: &SchemaRef,
    batches: &[RecordBatch],
    codec: Codec,
) -> Result<()> {
    let options = IpcWriteOptions::default().try_with_compression(codec.compression())?;
    let base = out.len();
    let n = schema.fields().len() + 1;
    // The rows' own bytes: batches sliced from one array would count the
    // whole shared buffer each under `get_array_memory_size`.
    let data: usize = batches.iter().map(data_bytes).sum();
    // The data, its IPC framing (a few hundred bytes per batch and column)
    // and the alignment padding.
    out.reserve(data + (batches.len() + 2) * n * 512 + PREFIX_LEN + n * ENTRY_LEN);
    let first = (PREFIX_LEN + n * ENTRY_LEN).next_multiple_of(ALIGN);
    out.resize(base + first, 0);
    let mut directory = Vec::with_capacity(n * ENTRY_LEN);
    let mut segment = |out: &mut Vec<u8>, one: &SchemaRef, cols: &[RecordBatch]| -> Result<()> {
        let at = (out.len() - base).next_multiple_of(ALIGN);
        out.resize(base + at, 0);
        {
            let mut w = arrow::ipc::writer::StreamWriter::try_new_with_options(
                &mut *out,
                one,
                options.clone(),
            )?;
            for b in cols {
                w.write(b)?;
            }
            w.finish()?;
        }
        let len = out.len() - base - at;
        directory.extend_from_slice(&(at as u64).to_le_bytes());
        directory.extend_from_slice(&(len as u64).to_le_bytes());
        directory.extend_from_slice(&crc32c::crc32c(&out[base + at..]).to_le_bytes());
        directory.extend_from_slice(&[0u8; 4]);
        Ok(())
    };
    segment(out, schema, &[])?;
    for (i, field) in schema.fields().iter().enumerate() {
        let blocks: Vec<ArrayRef> = batches.iter().map(|b| b.column(i).clone()).collect();
        let narrowed = if codec.narrows() {
            codec::narrow(field, &blocks)?
        } else {
            None
        };
        let (field, blocks) = narrowed.unwrap_or((field.clone(), blocks));
        let one = Arc::new(Schema::new(vec![field]));
        let cols = blocks
            .into_iter()
            .map(|c| RecordBatch::try_new(one.clone(), vec![c]))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        segment(out, &one, &cols)?;
    }
    debug_assert_eq!(directory.len(), n * ENTRY_LEN);
    let head = &mut out[base..base + PREFIX_LEN + n * ENTRY_LEN];
    head[..4].copy_from_slice(&(n as u32).to_le_bytes());
    head[4..8].copy_from_slice(&crc32c::crc32c(&directory).to_le_bytes());
    head[PREFIX_LEN..].copy_from_slice(&directory);
    Ok(())
}

/// Parses and checks the directory from the payload's first bytes.
/// `payload_len` bounds the segments.
fn directory(path: &Path, prefix: &[u8], payload_len: u64) -> Result<Vec<Segment>> {
    let bad = |why: String| Error::object(path, why);
    if prefix.len() < PREFIX_LEN {
        return Err(bad("truncated table directory".into()));
    }
    let n = u32::from_le_bytes(prefix[..4].try_into().expect("4 bytes")) as usize;
    if n == 0 || n > MAX_SEGMENTS {
        return Err(bad(format!("table directory declares {n} segments")));
    }
    let end = PREFIX_LEN + n * ENTRY_LEN;
    let Some(dir) = prefix.get(PREFIX_LEN..end) else {
        return Err(bad("truncated table directory".into()));
    };
    let crc = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes"));
    if crc32c::crc32c(dir) != crc {
        return Err(bad("table directory fails its checksum".into()));
    }
    let mut segs = Vec::with_capacity(n);
    let mut floor = end as u64;
    for e in dir.chunks_exact(ENTRY_LEN) {
        let s = Segment {
            offset: u64::from_le_bytes(e[..8].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(e[8..16].try_into().expect("8 bytes")),
            crc: u32::from_le_bytes(e[16..20].try_into().expect("4 bytes")),
        };
        let fits = s
            .offset
            .checked_add(s.len)
            .is_some_and(|e| e <= payload_len);
        if s.offset < floor || !fits {
            return Err(bad(format!(
                "table segment {} at {}+{} outside the payload of {payload_len} bytes",
                segs.len(),
                s.offset,
                s.len
            )));
        }
        floor = s.offset + s.len;
        segs.push(s);
    }
    Ok(segs)
}

/// Bytes of the prefix and directory of a payload of `n` segments.
fn directory_len(n: usize) -> usize {
    PREFIX_LEN + n * ENTRY_LEN
}

/// Decodes one segment's IPC stream (already checked) without copying
/// when `bytes` is aligned.
fn decode_stream(path: &Path, mut bytes: Buffer) -> Result<(Option<SchemaRef>, Vec<RecordBatch>)> {
    let bad =
        |e: arrow::error::ArrowError| Error::object(path, format!("damaged Arrow IPC stream: {e}"));
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    while !bytes.is_empty() {
        if let Some(b) = decoder.decode(&mut bytes).map_err(bad)? {
            batches.push(b);
        }
    }
    decoder.finish().map_err(bad)?;
    Ok((decoder.schema(), batches))
}

/// Checks a segment's bytes against its directory entry.
fn check(path: &Path, index: usize, seg: &Segment, bytes: &[u8]) -> Result<()> {
    if crc32c::crc32c(bytes) != seg.crc {
        let what = match index {
            0 => "the schema segment".to_string(),
            i => format!("column segment {}", i - 1),
        };
        return Err(Error::object(path, format!("{what} fails its checksum")));
    }
    Ok(())
}

/// Where the segments come from: a payload in memory, or an object file on
/// the device read segment by segment.
trait Source {
    /// The checked bytes of segment `index`, aligned for Arrow.
    fn segment(&mut self, index: usize, seg: &Segment) -> Result<Buffer>;
}

/// Assembles the table from its schema segment and the `columns`' segments
/// (all when `None`).
fn assemble(
    path: &Path,
    segs: &[Segment],
    columns: Option<&[String]>,
    src: &mut dyn Source,
) -> Result<Table> {
    let (schema, _) = decode_stream(path, src.segment(0, &segs[0])?)?;
    let schema = schema.ok_or_else(|| Error::object(path, "schema segment has no schema"))?;
    let (out_schema, idx) = projection(path, &schema, segs.len(), columns)?;
    let mut per_column = Vec::with_capacity(idx.len());
    for &i in &idx {
        let (_, batches) = decode_stream(path, src.segment(i + 1, &segs[i + 1])?)?;
        per_column.push(batches);
    }
    let blocks = per_column.first().map_or(0, Vec::len);
    if per_column.iter().any(|c| c.len() != blocks) {
        return Err(Error::object(
            path,
            "columns hold different numbers of row blocks",
        ));
    }
    let mut batches = Vec::with_capacity(blocks);
    for b in 0..blocks {
        let cols = per_column
            .iter()
            .zip(out_schema.fields())
            .map(|(c, want)| {
                codec::widen(want, c[b].schema().field(0), c[b].column(0).clone())
                    .map_err(|e| Error::object(path, e))
            })
            .collect::<Result<Vec<_>>>()?;
        let batch = if idx.is_empty() {
            RecordBatch::new_empty(out_schema.clone())
        } else {
            RecordBatch::try_new(out_schema.clone(), cols)
                .map_err(|e| Error::object(path, format!("row block {b}: {e}")))?
        };
        batches.push(batch);
    }
    Ok((out_schema, batches))
}

/// The schema of the `columns` named (all when `None`) and their indices
/// in `schema`, checking the schema against the directory's `segments`.
fn projection(
    path: &Path,
    schema: &SchemaRef,
    segments: usize,
    columns: Option<&[String]>,
) -> Result<(SchemaRef, Vec<usize>)> {
    if schema.fields().len() + 1 != segments {
        return Err(Error::object(
            path,
            format!(
                "schema has {} columns, directory {} column segments",
                schema.fields().len(),
                segments - 1
            ),
        ));
    }
    let idx: Vec<usize> = match columns {
        None => (0..schema.fields().len()).collect(),
        Some(cols) => cols
            .iter()
            .map(|c| {
                schema
                    .index_of(c)
                    .map_err(|_| Error::Plan(format!("unknown column {c:?} in {}", path.display())))
            })
            .collect::<Result<_>>()?,
    };
    Ok((Arc::new(schema.project(&idx)?), idx))
}

/// An aligned buffer holding a copy of `bytes`.
fn aligned(bytes: &[u8]) -> Buffer {
    let mut m = MutableBuffer::new(bytes.len());
    m.extend_from_slice(bytes);
    m.into()
}

struct InMemory<'a> {
    payload: &'a [u8],
}

impl Source for InMemory<'_> {
    fn segment(&mut self, _index: usize, seg: &Segment) -> Result<Buffer> {
        let (o, l) = (seg.offset as usize, seg.len as usize);
        Ok(aligned(&self.payload[o..o + l]))
    }
}

/// Decodes a columnar payload held in memory, only `columns` when given
/// (only their segments are copied). The payload must have passed the
/// object's whole-payload checksum ([`object::decode`]), which covers every
/// segment, so they are not checked again.
pub fn decode(
    path: &Path,
    payload: &[u8],
    columns: Option<&[String]>,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let segs = directory(path, payload, payload.len() as u64)?;
    assemble(path, &segs, columns, &mut InMemory { payload })
}

/// A decoded table: its schema and row blocks.
pub type Table = (SchemaRef, Vec<RecordBatch>);

// What reading a table off the device cost (defined with the device
// models, which charge its requests).
pub use crate::devmodel::ReadCost;

struct OnDevice<'a> {
    path: &'a Path,
    file: File,
    payload_at: u64,
    cost: &'a mut ReadCost,
}

/// Buffers that segments were read into, kept for the next read: a
/// Scan at scale factor 10 reads 120 MB column segments, and a fresh
/// buffer that large is fresh pages, faulted in and zeroed by the kernel
/// on every query (about as long as the read itself). A buffer is reused
/// only once no array refers to it any more (its last reference is the
/// pool's). At most [`POOLED`] are kept; the price is a node's resident
/// memory staying at its largest reads, as [`crate::node::keep_heap_warm`]
/// keeps its heap.
static READ_POOL: parking_lot::Mutex<Vec<Buffer>> = parking_lot::Mutex::new(Vec::new());

/// Most buffers [`READ_POOL`] keeps.
const POOLED: usize = 32;

/// Segments smaller than this are read into a fresh buffer (the heap
/// reuses those anyway).
const POOL_FROM: usize = 1 << 20;

/// A buffer of `len` bytes to read into: one of the pool's that nothing
/// refers to any more, else a new one.
fn read_buffer(len: usize) -> MutableBuffer {
    if len < POOL_FROM {
        return MutableBuffer::from_len_zeroed(len);
    }
    let mut pool = READ_POOL.lock();
    let mut found = None;
    let mut kept = Vec::with_capacity(pool.len());
    for b in pool.drain(..) {
        if found.is_some() || b.capacity() < len {
            kept.push(b);
            continue;
        }
        match b.into_mutable() {
            Ok(m) => found = Some(m),
            Err(b) => kept.push(b),
        }
    }
    *pool = kept;
    drop(pool);
    match found {
        Some(mut m) => {
            // Contents are overwritten by the read; only growth is zeroed.
            m.resize(len, 0);
            m
        }
        None => MutableBuffer::from_len_zeroed(len),
    }
}

/// Hands a buffer just read into to the pool too (see [`READ_POOL`]).
fn pool_read(b: &Buffer) {
    if b.len() < POOL_FROM {
        return;
    }
    let mut pool = READ_POOL.lock();
    if pool.len() >= POOLED {
        pool.remove(0);
    }
    pool.push(b.clone());
}

impl OnDevice<'_> {
    fn read(&mut self, at: u64, len: usize) -> Result<Buffer> {
        let t = Instant::now();
        let mut m = read_buffer(len);
        self.file
            .read_exact_at(m.as_slice_mut(), at)
            .map_err(|e| Error::io(self.path, e))?;
        self.cost.time += t.elapsed();
        self.cost.requests.push(len as u64);
        let b: Buffer = m.into();
        pool_read(&b);
        Ok(b)
    }
}

impl Source for OnDevice<'_> {
    fn segment(&mut self, index: usize, seg: &Segment) -> Result<Buffer> {
        let b = self.read(self.payload_at + seg.offset, seg.len as usize)?;
        let t = Instant::now();
        check(self.path, index, seg, &b)?;
        self.cost.time += t.elapsed();
        Ok(b)
    }
}

/// Reads a table object off the device, only the segments of `columns`
/// (all when `None`), checking the header, the directory and every segment
/// read. Returns the table and what the reads cost.
pub fn read(path: &Path, columns: Option<&[String]>) -> Result<(Table, ReadCost)> {
    let mut cost = ReadCost::default();
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let (file, segs) = open_table(path, file, &mut cost)?;
    let mut dev = OnDevice {
        path,
        file,
        payload_at: object::HEADER_LEN as u64,
        cost: &mut cost,
    };
    let table = assemble(path, &segs, columns, &mut dev)?;
    Ok((table, cost))
}

/// Opens the table object at `path`: reads and checks its header and its
/// directory (charging `cost`), and returns the file and the segments.
fn open_table(path: &Path, file: File, cost: &mut ReadCost) -> Result<(File, Vec<Segment>)> {
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut dev = OnDevice {
        path,
        file,
        payload_at: object::HEADER_LEN as u64,
        cost,
    };
    let head_len = (object::HEADER_LEN + PREFIX_LEN).min(file_len as usize);
    let head = dev.read(0, head_len)?;
    let (kind, payload_len) = object::decode_header(path, &head, file_len)?;
    if kind != object::Kind::Table {
        return Err(Error::object(path, "is not a table"));
    }
    let prefix = &head[object::HEADER_LEN..];
    let n = if prefix.len() >= 4 {
        u32::from_le_bytes(prefix[..4].try_into().expect("4 bytes")) as usize
    } else {
        0
    };
    let want = directory_len(n.min(MAX_SEGMENTS)).min(payload_len as usize);
    let dir_bytes = dev.read(object::HEADER_LEN as u64, want)?;
    let segs = directory(path, &dir_bytes, payload_len)?;
    Ok((dev.file, segs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};

    fn table() -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("v", DataType::Int64, false),
        ]));
        let batches = (0..3)
            .map(|b| {
                let n = 5 + b;
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from_iter_values((0..n).map(|i| i + 100 * b))),
                        Arc::new(StringArray::from_iter(
                            (0..n).map(|i| (i % 3 != 0).then(|| format!("row {i} of block {b}"))),
                        )),
                        Arc::new(Int64Array::from_iter_values((0..n).map(|i| -i))),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, batches)
    }

    fn write(dir: &Path, payload: &[u8]) -> std::path::PathBuf {
        let p = dir.join("t.obj");
        object::write_file(&p, &object::encode(object::Kind::Table, payload)).unwrap();
        p
    }

    #[test]
    fn a_projected_read_returns_exactly_the_named_columns_in_the_order_asked() {
        let (schema, batches) = table();
        let payload = encode(&schema, &batches).unwrap();
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), &payload);
        let cols = ["v".to_string(), "k".to_string()];
        let ((s, got), cost) = read(&p, Some(&cols)).unwrap();
        assert_eq!(
            s.fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect::<Vec<_>>(),
            ["v", "k"]
        );
        assert_eq!(got.len(), batches.len());
        for (g, b) in got.iter().zip(&batches) {
            assert_eq!(g.column(0), b.column(2));
            assert_eq!(g.column(1), b.column(0));
        }
        // Header, directory, schema, two columns; the string column unread.
        assert_eq!(cost.requests.len(), 5);
        assert!(
            cost.bytes() < payload.len() as u64,
            "{} of {}",
            cost.bytes(),
            payload.len()
        );
        let (_, all) = decode(&p, &payload, None).unwrap();
        assert_eq!(all, batches);
        let ((_, all), _) = read(&p, None).unwrap();
        assert_eq!(all, batches);
    }

    #[test]
    fn a_table_file_encoded_in_place_equals_the_payload_encoded_apart() {
        let (schema, batches) = table();
        let apart = object::encode(object::Kind::Table, &encode(&schema, &batches).unwrap());
        let file = table_file(&schema, &batches).unwrap();
        assert_eq!(file, apart);
        let (kind, payload) = object::decode(Path::new("t"), &file).unwrap();
        assert_eq!(kind, object::Kind::Table);
        let (_, back) = decode(Path::new("t"), payload, None).unwrap();
        assert_eq!(back, batches);
    }

    #[test]
    fn encoding_is_deterministic() {
        let (schema, batches) = table();
        assert_eq!(
            encode(&schema, &batches).unwrap(),
            encode(&schema, &batches).unwrap()
        );
    }

    #[test]
    fn a_flipped_byte_in_a_read_segment_is_an_error_naming_the_file() {
        let (schema, batches) = table();
        let payload = encode(&schema, &batches).unwrap();
        let d = tempfile::tempdir().unwrap();
        let segs = directory(Path::new("x"), &payload, payload.len() as u64).unwrap();
        // Every byte of the directory and of the segments read for column "s".
        let mut positions: Vec<usize> = (0..directory_len(segs.len())).collect();
        for s in [segs[0], segs[2]] {
            positions.extend(s.offset as usize..(s.offset + s.len) as usize);
        }
        for i in positions {
            let mut bad = payload.clone();
            bad[i] ^= 0x10;
            let p = write(d.path(), &bad);
            match read(&p, Some(&["s".to_string()])) {
                Err(e) => assert!(e.to_string().contains("t.obj"), "{e}"),
                Ok(_) => panic!("flip at payload byte {i} not detected"),
            }
        }
    }

    #[test]
    fn truncated_files_and_unknown_columns_are_refused() {
        let (schema, batches) = table();
        let payload = encode(&schema, &batches).unwrap();
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), &payload);
        let whole = std::fs::read(&p).unwrap();
        for len in [0, 20, 40, 100, whole.len() - 1] {
            std::fs::write(&p, &whole[..len]).unwrap();
            let e = read(&p, None).unwrap_err().to_string();
            assert!(e.contains("t.obj"), "{len}: {e}");
        }
        std::fs::write(&p, &whole).unwrap();
        let e = read(&p, Some(&["nope".to_string()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope"), "{e}");
    }
}
