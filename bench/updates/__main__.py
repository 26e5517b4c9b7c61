"""A corpus that changes while it serves: update throughput, search latency under updates, recall.

``python -m bench.updates --quick`` builds a staged IVF index (the service's default kind and
settings) over ``--passages`` synthetic documents (100,000 with ``--quick``), opens it as a live
corpus (:mod:`specrag.pipeline.store.live_corpus`: the durable log, fsynced per change, and the index
following) and measures, in one run:

1. update throughput, documents a second: replacements one at a time, then in batches of
   ``--batch`` (each batch one transaction and one swap);
2. search latency (the staged search as the service runs it, all stages, one query at a time)
   with no updates and while a steady ``--rate`` updates a second replace documents, in
   alternating rounds over the same queries: p50/p99 with bootstrap intervals and their ratio;
3. recall@5 against the exact top-5 of the live documents, after a fifth of the corpus was
   replaced, of the live index and of a fresh build of the same documents with the same settings;
4. compaction (the replaced rows dropped from the lists) and drift: ``--drifted`` documents
   (15 % of the corpus) from another mixture are added, and recall@5 of queries near them is
   measured with the build's centroids, after re-training them while serving, and on a fresh
   build; with the time each swap held writes back.

The documents' vectors are drawn from a Gaussian mixture (:mod:`specrag.retrieval.synthetic`) and
the replacements from the same mixture, so the old lists' centroids fit the new vectors as they
would for documents of the same kind; the documents carry their vector (a table embedder) and a
stand-in tokenizer gives each one token, so the throughput is that of the log and the index, not
of an embedding model or a tokenizer. Search latency is the retrieval's, not an answer's TTFT.

5. history: ``HISTORY_DOCUMENTS`` documents of a small corpus (``HISTORY_PASSAGES``) replaced
   ``HISTORY_REPLACEMENTS`` times in all, in batches of all of them; after the first batch and after
   the last, the log's bytes (file and WAL), and a start in a fresh process (open the store and
   replay its log, :meth:`LiveCorpus.replayed`): its time, its RSS, and the log's bytes after the
   start's checkpoint. A bounded history gives the same start after either (``--history-only``
   measures this alone).

Results: ``bench/out/updates.json`` and ``bench/out/updates.png``; the last line is the JSON
summary with ``recall_at5_fresh_build``, ``recall_at5_after_updates``,
``query_p99_ratio_updating_over_idle`` and the throughput figures. docs/updates.md quotes it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import machine, print_summary, write_json, write_report
from bench.updates.history import measure_history
from bench.updates.live import measure
from bench.updates.options import parse_args
from bench.updates.report import history_summary, plot, summary_line


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="specrag-updates-") as workdir:
        history = measure_history(args, Path(workdir))
        if args.history_only:
            path = write_json("updates-history", {"history": history, "machine": machine()})
            print_summary({**history_summary(history), "report": [str(path)]}, "bench.updates --history-only")
            return
        result = measure(args, Path(workdir))
    result["history"] = history
    result["machine"] = machine()
    json_path, png_path = write_report("updates", result, lambda path: plot(result, path))
    summary = summary_line(result, json_path, png_path)
    print_summary(summary, "bench.updates --quick   (full: drop --quick)")


if __name__ == "__main__":
    main()
