//! Writing a table object as its batches arrive, in bounded memory.
//!
//! A node's partition of `lineitem` at scale factor 10 is about 1.7 GB in
//! its storage types, more than a node may buffer for one put. The writer
//! streams each column's Arrow IPC stream into a spool file of its own next
//! to the object (so memory holds one batch, plus a write buffer per
//! column), then lays the object out exactly as [`super::encode_into`]
//! does with [`Codec::Plain`](crate::codec::Codec::Plain): the header, the
//! directory, and the segments copied from the spools at their aligned
//! offsets. The bytes are the same as encoding all the batches at once
//! (a test checks it): the redundancy layouts rebuild a lost node's file
//! bit-exact whichever way it was written.
//!
//! The object's header, which holds the payload's checksum, is written
//! last, into the room left for it; a durable object is synced and renamed
//! into place, so a crash leaves the old object or the new one. Dropping a
//! writer without [`TableWriter::finish`] removes its spools and leaves any
//! older object of that name alone: a put cut short stores nothing.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow::record_batch::RecordBatch;

use super::{ALIGN, ENTRY_LEN, PREFIX_LEN};
use crate::error::{Error, Result};
use crate::object;

/// Bytes each spool buffers before it writes.
const SPOOL_BUFFER: usize = 1 << 20;

/// A `Write` that keeps the crc32c and the length of what passes through.
struct Checked<W: Write> {
    inner: W,
    crc: u32,
    len: u64,
}

impl<W: Write> Write for Checked<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// One column's spool: its IPC stream, written as the batches arrive.
struct Spool {
    path: PathBuf,
    schema: SchemaRef,
    writer: StreamWriter<Checked<BufWriter<File>>>,
}

/// A table object being written batch by batch; see the module docs.
pub struct TableWriter {
    path: PathBuf,
    schema: SchemaRef,
    spools: Vec<Spool>,
    /// Set once the spools are handed over (finished or dropped).
    done: bool,
}

impl std::fmt::Debug for TableWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableWriter")
            .field("path", &self.path)
            .field("columns", &self.spools.len())
            .finish()
    }
}

impl TableWriter {
    /// Starts the object at `path` (an older object stays until
    /// [`TableWriter::finish`]) for batches of `schema`.
    pub fn create(path: &Path, schema: &SchemaRef) -> Result<TableWriter> {
        let mut w = TableWriter {
            path: path.to_path_buf(),
            schema: schema.clone(),
            spools: Vec::with_capacity(schema.fields().len()),
            done: false,
        };
        for (i, field) in schema.fields().iter().enumerate() {
            let spool = spool_path(path, i);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&spool)
                .map_err(|e| Error::io(&spool, e))?;
            let one = Arc::new(Schema::new(vec![field.clone()]));
            let out = Checked {
                inner: BufWriter::with_capacity(SPOOL_BUFFER, file),
                crc: 0,
                len: 0,
            };
            let writer = StreamWriter::try_new_with_options(out, &one, IpcWriteOptions::default())?;
            w.spools.push(Spool {
                path: spool,
                schema: one,
                writer,
            });
        }
        Ok(w)
    }

    /// Appends a batch (of the writer's schema).
    pub fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.schema().fields() != self.schema.fields() {
            return Err(Error::Invalid(format!(
                "{}: a batch of other columns than the table's",
                self.path.display()
            )));
        }
        for (spool, column) in self.spools.iter_mut().zip(batch.columns()) {
            let one = RecordBatch::try_new(spool.schema.clone(), vec![column.clone()])?;
            spool.writer.write(&one)?;
        }
        Ok(())
    }

    /// Lays the object out from the spools, writes its header, and puts it
    /// in place (synced and renamed when `durable`); returns its length.
    pub fn finish(mut self, durable: bool) -> Result<u64> {
        self.done = true;
        let spools = std::mem::take(&mut self.spools);
        let paths: Vec<PathBuf> = spools.iter().map(|s| s.path.clone()).collect();
        let result = self.finish_spools(spools, durable);
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
        if result.is_err() {
            // A layout cut short (a full device, a failed rename) leaves
            // neither its temporary file nor any change to the object.
            let _ = std::fs::remove_file(self.path.with_extension("tmp"));
        }
        result
    }

    fn finish_spools(&self, spools: Vec<Spool>, durable: bool) -> Result<u64> {
        // Segment 0: the schema alone, as `encode_into` writes it.
        let mut schema_segment = Vec::new();
        {
            let mut w = StreamWriter::try_new_with_options(
                &mut schema_segment,
                &self.schema,
                IpcWriteOptions::default(),
            )?;
            w.finish()?;
        }
        let mut segments = vec![(schema_segment.len() as u64, crc32c::crc32c(&schema_segment))];
        let mut spool_files = Vec::with_capacity(spools.len());
        for spool in spools {
            let mut w = spool.writer;
            w.finish()?;
            let out = w.into_inner()?;
            let (crc, len) = (out.crc, out.len);
            let file = out
                .inner
                .into_inner()
                .map_err(|e| Error::io(&spool.path, e.into_error()))?;
            segments.push((len, crc));
            spool_files.push((spool.path, file));
        }
        self.lay_out(&schema_segment, &segments, &spool_files, durable)
    }

    fn lay_out(
        &self,
        schema_segment: &[u8],
        segments: &[(u64, u32)],
        spools: &[(PathBuf, File)],
        durable: bool,
    ) -> Result<u64> {
        let n = segments.len();
        let first = (PREFIX_LEN + n * ENTRY_LEN).next_multiple_of(ALIGN) as u64;
        let mut directory = Vec::with_capacity(n * ENTRY_LEN);
        let mut at = first;
        let mut offsets = Vec::with_capacity(n);
        for &(len, crc) in segments {
            offsets.push(at);
            directory.extend_from_slice(&at.to_le_bytes());
            directory.extend_from_slice(&len.to_le_bytes());
            directory.extend_from_slice(&crc.to_le_bytes());
            directory.extend_from_slice(&[0u8; 4]);
            at = (at + len).next_multiple_of(ALIGN as u64);
        }
        let payload_len = offsets[n - 1] + segments[n - 1].0;
        let tmp = self.path.with_extension("tmp");
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = Checked {
            inner: BufWriter::with_capacity(SPOOL_BUFFER, &file),
            crc: 0,
            len: 0,
        };
        let io = |e| Error::io(&tmp, e);
        // Room for the object header; the payload's checksum starts after.
        out.inner
            .write_all(&[0u8; object::HEADER_LEN])
            .map_err(io)?;
        out.write_all(&(n as u32).to_le_bytes()).map_err(io)?;
        out.write_all(&crc32c::crc32c(&directory).to_le_bytes())
            .map_err(io)?;
        out.write_all(&directory).map_err(io)?;
        let zeros = [0u8; ALIGN];
        let mut copy = vec![0u8; SPOOL_BUFFER];
        for (i, &offset) in offsets.iter().enumerate() {
            let pad = (offset - out.len) as usize;
            out.write_all(&zeros[..pad]).map_err(io)?;
            if i == 0 {
                out.write_all(schema_segment).map_err(io)?;
                continue;
            }
            let (spool_path, spool) = &spools[i - 1];
            let from = spool;
            let mut copied = 0u64;
            // Read back from the start (the spool's cursor is at its end).
            let mut pos = 0u64;
            loop {
                let got = from
                    .read_at(&mut copy, pos)
                    .map_err(|e| Error::io(spool_path, e))?;
                if got == 0 {
                    break;
                }
                pos += got as u64;
                out.write_all(&copy[..got]).map_err(io)?;
                copied += got as u64;
            }
            if copied != segments[i].0 {
                return Err(Error::object(
                    spool_path,
                    format!("spool holds {copied} bytes, wrote {}", segments[i].0),
                ));
            }
        }
        debug_assert_eq!(out.len, payload_len);
        let crc = out.crc;
        out.flush().map_err(io)?;
        drop(out);
        file.write_all_at(&object::header(object::Kind::Table, payload_len, crc), 0)
            .map_err(io)?;
        if durable {
            file.sync_data().map_err(io)?;
        }
        drop(file);
        std::fs::rename(&tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        Ok(object::HEADER_LEN as u64 + payload_len)
    }
}

impl Drop for TableWriter {
    fn drop(&mut self) {
        if !self.done {
            for s in &self.spools {
                let _ = std::fs::remove_file(&s.path);
            }
        }
    }
}

/// Where column `i` of the object at `path` is spooled.
fn spool_path(path: &Path, i: usize) -> PathBuf {
    path.with_extension(format!("spool{i}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};

    fn batches() -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
        ]));
        let b = (0..5)
            .map(|i| {
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from_iter_values(i * 100..i * 100 + 37 + i)),
                        Arc::new(StringArray::from_iter(
                            (0..37 + i).map(|j| (j % 3 != 0).then(|| format!("row {j}"))),
                        )),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, b)
    }

    #[test]
    fn a_streamed_object_is_byte_for_byte_the_object_encoded_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.obj");
        let (schema, b) = batches();
        let mut w = TableWriter::create(&path, &schema).unwrap();
        for x in &b {
            w.write(x).unwrap();
        }
        let len = w.finish(true).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written.len() as u64, len);
        assert_eq!(written, crate::columnar::table_file(&schema, &b).unwrap());
        let (table, _) = crate::columnar::read(&path, None).unwrap();
        assert_eq!(table.1, b);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "spools and the temporary file are gone");
    }

    #[test]
    fn a_writer_dropped_unfinished_leaves_the_older_object_and_no_spools() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.obj");
        let (schema, b) = batches();
        let old = crate::columnar::table_file(&schema, &b[..1]).unwrap();
        std::fs::write(&path, &old).unwrap();
        let mut w = TableWriter::create(&path, &schema).unwrap();
        w.write(&b[2]).unwrap();
        drop(w);
        assert_eq!(std::fs::read(&path).unwrap(), old);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_layout_that_fails_leaves_no_temporary_file_or_spool() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.obj");
        // A directory where the object goes: the final rename fails.
        std::fs::create_dir(&path).unwrap();
        let (schema, b) = batches();
        let mut w = TableWriter::create(&path, &schema).unwrap();
        w.write(&b[0]).unwrap();
        assert!(w.finish(true).is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("t.obj")]);
        assert!(path.is_dir(), "what was there is untouched");
    }

    #[test]
    fn an_empty_table_streams_to_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.obj");
        let (schema, _) = batches();
        TableWriter::create(&path, &schema)
            .unwrap()
            .finish(false)
            .unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            crate::columnar::table_file(&schema, &[]).unwrap()
        );
    }

    #[test]
    fn a_batch_of_other_columns_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (schema, _) = batches();
        let mut w = TableWriter::create(&dir.path().join("t.obj"), &schema).unwrap();
        let other = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)])),
            vec![Arc::new(Int64Array::from(vec![1]))],
        )
        .unwrap();
        assert!(
            w.write(&other)
                .unwrap_err()
                .to_string()
                .contains("other columns")
        );
    }
}
