"""The current-version folder: the newest version a node can produce, as a model folder.

A rollout node keeps ``DATA/current`` so that ``vllm serve DATA/current`` (or
``LLM(...)``) starts on the latest policy, and ``sparrowd checkout`` writes the
same kind of folder for any version it can produce::

    DATA/current -> folders/<n>            a symlink, replaced atomically when the folder is rebuilt
    DATA/folders/<n>/
        model.safetensors                  (or model-0000k-of-0000N.safetensors + the index)
        config.json, tokenizer.json, ...   the anchor's files
        sparrowd.json                      version and fingerprints: the commit record
        .sparrowd.lock                     flock: shared while an engine loads, exclusive while updating
    DATA/current.journal                   the redo journal of the update in progress

*Building* (from an anchor: a box with nothing, or one that fell behind the
swarm's retention) writes a new folder beside the old one, checks every
tensor's fingerprint against the anchor's manifest, and only then swings the
symlink. *Updating* (one patch) is in place and costs O(changed elements):

1. the new bit patterns of every changed element (ulp distances resolved
   against the folder's current bits) are written to the redo journal, which
   is fsynced and renamed into place; from here the version is committed;
2. the journal is replayed into the shards through writable mappings and the
   touched tensors' fingerprints are checked against the manifest;
3. ``sparrowd.json`` is replaced (the folder's version moves) and the
   journal removed.

A crash before step 1 ends leaves the folder untouched; a crash after it is
repaired at the next start by replaying the journal, which writes absolute
values and so can be replayed any number of times. The folder is therefore
always exactly one version, whatever the kill point.

Engines that have the folder open are not disturbed. An engine with the
sparrowd vLLM plugin holds the lock shared while it loads, and an update
waits for it. For every other reader, each shard is first leased
(``F_SETLEASE``, ``F_WRLCK``): the kernel grants it only while no other process
has the file open or mapped, and holds back anyone who opens it until the
update is whole. A shard that is in use is copied, updated and renamed over
instead, so the reader keeps the bytes it mapped.

Disk: one model's bytes plus the journal (the changed elements: 8 + the
element width bytes each). At ~1% uniform density nearly every 4 KiB page
holds a change, so the page cache writes most of each shard back although the
process writes only the changed elements.

The modules, by job: ``ondisk`` (the files above, the lock, the errors),
``shards`` (mappings of the shards, leases), ``journal`` (an update and its
replay: steps 1 to 3), ``build`` (a folder from an anchor, or adopted from a
local base), ``folder`` (``CurrentFolder``: ``DATA/current`` itself). They
import ``checkpoint``, ``codec``, ``decoded``, ``errors`` and ``schema``,
never the daemon; this module only re-exports the public names.
"""

from __future__ import annotations

from .build import adopt_folder, base_of, build_folder
from .folder import CurrentFolder
from .journal import update_folder
from .ondisk import (
           LOCK,
           MARKER,
           FolderBusy,
           HistoryMissing,
           LayoutChange,
           model_files,
           read_history,
           read_marker,
           reading,
)

__all__ = ["CurrentFolder", "FolderBusy", "LayoutChange", "HistoryMissing", "read_history", "model_files", "base_of",
           "adopt_folder", "read_marker", "reading", "build_folder", "update_folder", "MARKER", "LOCK"]
