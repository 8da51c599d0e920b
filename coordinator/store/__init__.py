"""The object store as the coordinator uses it: the seam, and everything that reads or writes it.

May import ``base``, ``state``, ``rules`` and ``monitoring``.

    object_store.py  the object-store Protocol the coordinator talks to, its values, helpers
    storage.py       its boto3 implementation, ``S3Store`` (the only botocore import: its errors
                     leave as StorageError)
    head.py          the HEAD that checks each submission, presigned and sent with aiohttp
    presign.py       presigned URLs (SigV4) in microseconds, used once shown equal to boto3's
    promises.py      what a store promises and what the coordinator does with each answer
    conformance.py   the store check: every promise tried with throwaway keys
    multipart.py     multipart uploads on the store: create, presign parts, complete write-once,
                     abort the stale
    storewatch.py    whether the store answers; deadlines pause while it does not
    verify.py        reading an uploaded checkpoint back and verifying it before the commit
    datasets.py      the run's dataset: its manifest checked at start, GETs for its files only
    publisher.py     uploads signed manifests, checkpoint sidecars and latest.json, retrying
    retention.py     deletes old payloads and checkpoints from the store
    catchup.py       at start, the rounds the store's signed manifests say closed since a backup
"""
