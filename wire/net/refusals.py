"""The fields a coordinator's refusal of a push carries in its trailing metadata, for the site
to read as fields rather than from the words (both ends import them from here).

- ``isthmus-committed-by``: the site whose copy of a data unit was committed first (shared-data
  mode), on a push of another copy.
- ``isthmus-fold-round``: the round a late update folds into (the next round of its fragment
  still open), on a push refused as ``later`` (``FAILED_PRECONDITION``): the site sends the
  update again once that round is open.
"""

from __future__ import annotations

COMMITTED_BY = "isthmus-committed-by"
FOLD_ROUND = "isthmus-fold-round"
