//! Reading a table object one row block at a time, in bounded memory.
//!
//! [`super::read`] decodes whole column segments: at scale factor 10 one
//! node's share of a 64-bit column is a 120 MB segment, and Q1's Scan
//! needs seven of them. A primitive that runs in the node's bounded
//! working memory (see [`crate::ops::bounded`]) reads its input through
//! [`RowBlocks`] instead: each column segment it needs is read in
//! [`READ_CHUNK`]-byte requests and fed to an incremental Arrow IPC
//! decoder, and the columns are zipped into one batch per row block as
//! their blocks complete. Memory holds one read chunk per column plus the
//! row blocks the consumer still holds.
//!
//! Each segment's crc32c (the directory's, see [`super`]) is checked
//! before any of it is decoded, by a first pass (made by the first read) that reads the segment a
//! chunk at a time for its checksum alone (Arrow's IPC decoder may panic
//! on damaged metadata rather than fail). The second pass, which decodes,
//! computes it again and checks it when the segment ends, so the bytes
//! decoded are the bytes checked; a panic of the decoder there (bytes that
//! changed between the passes) is caught and is the same error. Either way
//! a damaged object never yields a result: the primitive's output is
//! committed only after the input ended without an error.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arrow::buffer::Buffer;
use arrow::datatypes::{FieldRef, SchemaRef};
use arrow::ipc::reader::StreamDecoder;
use arrow::record_batch::RecordBatch;
use parking_lot::Mutex;

use super::{ReadCost, Segment, check, codec, decode_stream, open_table, projection};
use crate::error::{Error, Result};

/// Bytes of one read request into a column segment: small next to a
/// node's memory, large enough that a device's per-request cost stays
/// small next to the transfer.
pub const READ_CHUNK: usize = 1 << 20;

/// One column segment being read.
struct Column {
    /// Segment index in the directory (column `index - 1`).
    index: usize,
    seg: Segment,
    /// Bytes of the segment read so far.
    read: u64,
    /// crc32c of those bytes.
    crc: u32,
    decoder: StreamDecoder,
    /// The part of the last chunk not yet decoded.
    pending: Buffer,
    /// The column's field in the table's schema (what it widens to).
    want: FieldRef,
}

/// A table object's row blocks, read and decoded one at a time; see the
/// module docs. Blocks are projected to the columns asked for.
pub struct RowBlocks {
    path: PathBuf,
    file: File,
    payload_at: u64,
    schema: SchemaRef,
    columns: Vec<Column>,
    blocks: u64,
    cost: Arc<Mutex<ReadCost>>,
    /// Bytes of the segments still to be read, summed at open.
    bytes: u64,
    /// Whether the segments' checksums passed (the first read checks).
    checked: bool,
    ended: bool,
}

impl std::fmt::Debug for RowBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowBlocks")
            .field("path", &self.path)
            .field("columns", &self.columns.len())
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl RowBlocks {
    /// Opens the table object at `path` for the `columns` named (all when
    /// `None`), checking its header, directory and schema segment. What
    /// the reads cost is added to `cost` as they happen. The column
    /// segments' checksums are checked by the first read.
    pub fn open(
        path: &Path,
        columns: Option<&[String]>,
        cost: Arc<Mutex<ReadCost>>,
    ) -> Result<RowBlocks> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        RowBlocks::open_file(path, file, columns, cost)
    }

    /// [`RowBlocks::open`] over `file`, already open on the object at
    /// `path`: a reader that holds an object open reads it as it was,
    /// whatever replaces the name since.
    pub fn open_file(
        path: &Path,
        file: File,
        columns: Option<&[String]>,
        cost: Arc<Mutex<ReadCost>>,
    ) -> Result<RowBlocks> {
        let (file, segs) = {
            let mut c = cost.lock();
            open_table(path, file, &mut c)?
        };
        let mut guard = cost.lock();
        let schema_bytes = read_at(
            path,
            &file,
            object_payload_at() + segs[0].offset,
            segs[0].len as usize,
            &mut guard,
        )?;
        check(path, 0, &segs[0], &schema_bytes)?;
        drop(guard);
        let (schema, _) = decode_stream(path, schema_bytes)?;
        let schema = schema.ok_or_else(|| Error::object(path, "schema segment has no schema"))?;
        let (out_schema, idx) = projection(path, &schema, segs.len(), columns)?;
        let columns: Vec<Column> = idx
            .iter()
            .enumerate()
            .map(|(pos, &i)| Column {
                index: i + 1,
                seg: segs[i + 1],
                read: 0,
                crc: 0,
                decoder: StreamDecoder::new(),
                pending: Buffer::from_vec(Vec::<u8>::new()),
                want: out_schema.field(pos).clone().into(),
            })
            .collect();
        let bytes = columns.iter().map(|c| c.seg.len).sum();
        Ok(RowBlocks {
            path: path.to_path_buf(),
            file,
            payload_at: object_payload_at(),
            schema: out_schema,
            columns,
            blocks: 0,
            cost,
            bytes,
            checked: false,
            ended: false,
        })
    }

    /// The file read (open on the object as it was when opened).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The object's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks every needed segment's checksum before any of it is
    /// decoded: Arrow's IPC decoder may panic on damaged metadata, so a
    /// first pass reads each one a chunk at a time for its crc alone.
    fn check_segments(&mut self) -> Result<()> {
        let mut buf = vec![0u8; READ_CHUNK];
        for c in &self.columns {
            let t = Instant::now();
            let mut crc = 0;
            let mut at = 0;
            while at < c.seg.len {
                let len = (c.seg.len - at).min(READ_CHUNK as u64) as usize;
                self.file
                    .read_exact_at(&mut buf[..len], self.payload_at + c.seg.offset + at)
                    .map_err(|e| Error::io(&self.path, e))?;
                crc = crc32c::crc32c_append(crc, &buf[..len]);
                at += len as u64;
            }
            let mut cost = self.cost.lock();
            cost.time += t.elapsed();
            cost.requests.push(c.seg.len);
            if crc != c.seg.crc {
                return Err(segment_damaged(&self.path, c.index));
            }
        }
        self.checked = true;
        Ok(())
    }

    /// The schema of the blocks yielded.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Bytes of the column segments this reader reads (about the decoded
    /// size of the columns for objects stored plain).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The next block of column `c`, or `None` once its segment ended
    /// (decoded to its end and its checksum checked).
    fn next_of(&mut self, c: usize) -> Result<Option<RecordBatch>> {
        let bad = |path: &Path, e: arrow::error::ArrowError| {
            Error::object(path, format!("damaged Arrow IPC stream: {e}"))
        };
        loop {
            let col = &mut self.columns[c];
            if !col.pending.is_empty() {
                // A segment that changed since its check could still make
                // the decoder panic: that is a damaged object too.
                let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    col.decoder.decode(&mut col.pending)
                }))
                .map_err(|_| {
                    Error::object(&self.path, "damaged Arrow IPC stream (the decoder gave up)")
                })?;
                if let Some(b) = decoded.map_err(|e| bad(&self.path, e))? {
                    return Ok(Some(b));
                }
                continue;
            }
            if col.read == col.seg.len {
                col.decoder.finish().map_err(|e| bad(&self.path, e))?;
                // Checked again: the bytes decoded are the bytes checked.
                if col.crc != col.seg.crc {
                    return Err(segment_damaged(&self.path, col.index));
                }
                return Ok(None);
            }
            let len = (col.seg.len - col.read).min(READ_CHUNK as u64) as usize;
            let at = self.payload_at + col.seg.offset + col.read;
            let chunk = read_at(&self.path, &self.file, at, len, &mut self.cost.lock())?;
            let col = &mut self.columns[c];
            col.crc = crc32c::crc32c_append(col.crc, &chunk);
            col.read += len as u64;
            col.pending = chunk;
        }
    }

    fn next_block(&mut self) -> Result<Option<RecordBatch>> {
        if self.columns.is_empty() {
            return Ok(None);
        }
        if !self.checked {
            self.check_segments()?;
        }
        let mut parts = Vec::with_capacity(self.columns.len());
        for c in 0..self.columns.len() {
            parts.push(self.next_of(c)?);
        }
        let got = parts.iter().filter(|p| p.is_some()).count();
        if got == 0 {
            return Ok(None);
        }
        if got != parts.len() {
            return Err(Error::object(
                &self.path,
                "columns hold different numbers of row blocks",
            ));
        }
        let cols = parts
            .into_iter()
            .zip(&self.columns)
            .map(|(p, c)| {
                let p = p.expect("counted");
                codec::widen(&c.want, p.schema().field(0), p.column(0).clone())
                    .map_err(|e| Error::object(&self.path, e))
            })
            .collect::<Result<Vec<_>>>()?;
        let b = RecordBatch::try_new(self.schema.clone(), cols)
            .map_err(|e| Error::object(&self.path, format!("row block {}: {e}", self.blocks)))?;
        self.blocks += 1;
        Ok(Some(b))
    }
}

impl Iterator for RowBlocks {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Result<RecordBatch>> {
        if self.ended {
            return None;
        }
        match self.next_block() {
            Ok(Some(b)) => Some(Ok(b)),
            Ok(None) => {
                self.ended = true;
                None
            }
            Err(e) => {
                self.ended = true;
                Some(Err(e))
            }
        }
    }
}

/// The error of column segment `index` (in the directory) failing its
/// checksum.
fn segment_damaged(path: &Path, index: usize) -> Error {
    Error::object(
        path,
        format!("column segment {} fails its checksum", index - 1),
    )
}

/// Where an object file's payload starts.
fn object_payload_at() -> u64 {
    crate::object::HEADER_LEN as u64
}

/// Reads `len` bytes at `at` into a fresh aligned buffer, charging `cost`.
fn read_at(path: &Path, file: &File, at: u64, len: usize, cost: &mut ReadCost) -> Result<Buffer> {
    let t = Instant::now();
    let mut m = arrow::buffer::MutableBuffer::from_len_zeroed(len);
    file.read_exact_at(m.as_slice_mut(), at)
        .map_err(|e| Error::io(path, e))?;
    cost.time += t.elapsed();
    cost.requests.push(len as u64);
    Ok(m.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::columnar::{encode, read, table_file_with};
    use crate::object;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    fn table(blocks: usize, rows: usize) -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("v", DataType::Int64, false),
        ]));
        let batches = (0..blocks)
            .map(|b| {
                let n = rows + b;
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from_iter_values(
                            (0..n as i64).map(|i| i + 100 * b as i64),
                        )),
                        Arc::new(StringArray::from_iter(
                            (0..n).map(|i| (i % 3 != 0).then(|| format!("row {i} of block {b}"))),
                        )),
                        Arc::new(Int64Array::from_iter_values((0..n as i64).map(|i| -i))),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, batches)
    }

    fn write(dir: &Path, file: &[u8]) -> PathBuf {
        let p = dir.join("t.obj");
        object::write_file(&p, file).unwrap();
        p
    }

    fn cost() -> Arc<Mutex<ReadCost>> {
        Arc::new(Mutex::new(ReadCost::default()))
    }

    #[test]
    fn row_blocks_equal_a_whole_read_of_the_same_columns_across_many_read_chunks() {
        // Segments of several read chunks each, so blocks span chunks.
        let (schema, batches) = table(40, 9000);
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            &crate::columnar::table_file(&schema, &batches).unwrap(),
        );
        let cols = ["v".to_string(), "s".to_string()];
        let ((want_schema, want), _) = read(&p, Some(&cols)).unwrap();
        let c = cost();
        let r = RowBlocks::open(&p, Some(&cols), c.clone()).unwrap();
        assert_eq!(r.schema(), &want_schema);
        let seg_bytes = r.bytes();
        assert!(seg_bytes > 2 * READ_CHUNK as u64, "{seg_bytes}");
        let got = r.collect::<Result<Vec<_>>>().unwrap();
        assert_eq!(got, want);
        // Each segment read twice (checked, then decoded); the column "k"
        // never.
        let read_bytes = c.lock().bytes();
        assert!(
            read_bytes < 2 * seg_bytes + 4096,
            "{read_bytes} of {seg_bytes}"
        );
        let all = RowBlocks::open(&p, None, cost())
            .unwrap()
            .collect::<Result<Vec<_>>>()
            .unwrap();
        assert_eq!(all, batches);
    }

    #[test]
    fn narrowed_and_compressed_checkpoint_columns_read_back_widened() {
        let (schema, batches) = table(3, 500);
        let d = tempfile::tempdir().unwrap();
        for codec in [
            crate::codec::Codec::Lz4,
            crate::codec::Codec::Zstd,
            crate::codec::Codec::Narrow,
        ] {
            let p = write(
                d.path(),
                &table_file_with(&schema, &batches, codec).unwrap(),
            );
            let got = RowBlocks::open(&p, None, cost())
                .unwrap()
                .collect::<Result<Vec<_>>>()
                .unwrap();
            assert_eq!(got, batches, "{codec:?}");
        }
    }

    #[test]
    fn a_flipped_byte_in_a_column_segment_is_refused_before_it_is_decoded() {
        let (schema, batches) = table(4, 50);
        let payload = encode(&schema, &batches).unwrap();
        let segs =
            crate::columnar::directory(Path::new("x"), &payload, payload.len() as u64).unwrap();
        let d = tempfile::tempdir().unwrap();
        // Every byte of column "v"'s segment (the last), read alone.
        let s = segs[3];
        for i in (s.offset..s.offset + s.len).step_by(7) {
            let mut bad = payload.clone();
            bad[i as usize] ^= 0x10;
            let p = write(d.path(), &object::encode(object::Kind::Table, &bad));
            // Refused by the first read, before any block is decoded.
            match RowBlocks::open(&p, Some(&["v".to_string()]), cost())
                .and_then(|mut r| r.next().transpose())
            {
                Err(e) => assert!(e.to_string().contains("fails its checksum"), "{e}"),
                Ok(_) => panic!("flip at payload byte {i} not detected"),
            }
        }
    }

    #[test]
    fn truncated_files_and_unknown_columns_are_refused_at_open() {
        let (schema, batches) = table(2, 20);
        let d = tempfile::tempdir().unwrap();
        let whole = crate::columnar::table_file(&schema, &batches).unwrap();
        let p = write(d.path(), &whole);
        for len in [0, 20, 40, 100, whole.len() - 1] {
            std::fs::write(&p, &whole[..len]).unwrap();
            let e = RowBlocks::open(&p, None, cost()).unwrap_err().to_string();
            assert!(e.contains("t.obj"), "{len}: {e}");
        }
        std::fs::write(&p, &whole).unwrap();
        let e = RowBlocks::open(&p, Some(&["nope".to_string()]), cost())
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope"), "{e}");
    }
}
