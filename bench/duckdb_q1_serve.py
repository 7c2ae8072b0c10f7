#!/usr/bin/env python3
"""DuckDB peer for `rebound bench smartstore --scale`: TPC-H Q1 from Parquet,
at scale factors whose table does not fit in memory twice.

Usage:
  duckdb_q1_serve.py convert PARQUET   < Arrow IPC stream on stdin
  duckdb_q1_serve.py serve PARQUET     (then one command per stdin line)

convert: writes the Arrow IPC stream rebound sends on stdin (the generated
rows, in order, as they are generated) to PARQUET, row groups of about a
million rows, without holding the table: prints one JSON line
{"rows": N, "seconds": S, "bytes": B}.

serve: opens DuckDB over PARQUET, runs Q1 once to warm it (file cache,
catalog), prints {"ready": true, "threads": N}, then for each line "q1" on
stdin runs Q1 once and prints {"seconds": S, "rows": [...]}, each row
[flag, status, sum_qty, sum_base_price, sum_disc_price, sum_charge,
count_order] with the sums rounded half up to 2 places as TPC-H prints
them. One process across rounds, so rounds interleave with rebound's.
"""
import decimal
import json
import os
import sys
import time

import duckdb
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

# The same Q1 text as the sf 1 peer (this script's folder is on sys.path).
from duckdb_q1 import Q1  # noqa: E402

ROW_GROUP = 1 << 20


def convert(path):
    t = time.perf_counter()
    rows = 0
    with ipc.open_stream(sys.stdin.buffer) as reader:
        writer = None
        pending, pending_rows = [], 0
        for batch in reader:
            if writer is None:
                writer = pq.ParquetWriter(path, batch.schema)
            pending.append(batch)
            pending_rows += batch.num_rows
            rows += batch.num_rows
            if pending_rows >= ROW_GROUP:
                writer.write_table(pa.Table.from_batches(pending), row_group_size=ROW_GROUP)
                pending, pending_rows = [], 0
        if writer is None:
            writer = pq.ParquetWriter(path, reader.schema)
        if pending:
            writer.write_table(pa.Table.from_batches(pending), row_group_size=ROW_GROUP)
        writer.close()
    print(json.dumps({
        "rows": rows,
        "seconds": time.perf_counter() - t,
        "bytes": os.path.getsize(path),
    }), flush=True)


def cents(d):
    return str(decimal.Decimal(d).quantize(decimal.Decimal("0.01"), rounding=decimal.ROUND_HALF_UP))


def serve(path):
    con = duckdb.connect()
    sql = Q1.format(path=path)
    con.execute(sql).fetchall()
    threads = con.execute("select current_setting('threads')").fetchone()[0]
    print(json.dumps({"ready": True, "threads": int(threads)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "q1":
            print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)
            continue
        t = time.perf_counter()
        rows = con.execute(sql).fetchall()
        s = time.perf_counter() - t
        print(json.dumps({
            "seconds": s,
            "rows": [[r[0], r[1], cents(r[2]), cents(r[3]), cents(r[4]), cents(r[5]), int(r[9])]
                     for r in rows],
        }), flush=True)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "convert":
        convert(path)
    elif mode == "serve":
        serve(path)
    else:
        sys.exit(f"unknown mode {mode!r}: want convert or serve")


if __name__ == "__main__":
    main()
