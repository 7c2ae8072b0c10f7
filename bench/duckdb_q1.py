#!/usr/bin/env python3
"""DuckDB peer for `rebound bench smartstore`: TPC-H Q1 from Parquet.

Usage: duckdb_q1.py LINEITEM.arrows WORKDIR RUNS

Converts the Arrow IPC stream written by rebound (the same generated rows
the storage nodes hold) to Parquet, then times Q1 over the Parquet file with
DuckDB: one warm-up, then RUNS timed runs. Prints one JSON line:
{"median_s": ..., "runs_s": [...], "rows": [[flag, status, count], ...],
 "threads": N}.
"""
import json
import statistics
import sys
import time

import duckdb
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

Q1 = """
select l_returnflag, l_linestatus,
       sum(l_quantity) as sum_qty,
       sum(l_extendedprice) as sum_base_price,
       sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
       sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
       avg(l_quantity) as avg_qty,
       avg(l_extendedprice) as avg_price,
       avg(l_discount) as avg_disc,
       count(*) as count_order
from read_parquet('{path}')
where l_shipdate <= date '1998-12-01' - interval '90' day
group by l_returnflag, l_linestatus
order by l_returnflag, l_linestatus
"""


def main():
    src, work, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with ipc.open_stream(src) as reader:
        table = reader.read_all()
    path = f"{work}/lineitem.parquet"
    pq.write_table(table, path)
    con = duckdb.connect()
    sql = Q1.format(path=path)
    con.execute(sql).fetchall()  # warm-up: file cache, catalog
    times = []
    rows = None
    for _ in range(runs):
        t = time.perf_counter()
        rows = con.execute(sql).fetchall()
        times.append(time.perf_counter() - t)
    threads = con.execute("select current_setting('threads')").fetchone()[0]
    print(json.dumps({
        "median_s": statistics.median(times),
        "runs_s": times,
        "rows": [[r[0], r[1], int(r[9])] for r in rows],
        "threads": int(threads),
    }))


if __name__ == "__main__":
    main()
