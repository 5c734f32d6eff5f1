"""ckptd: the checkpoint service of scaletrain (one per node).

It takes the files of a sharded torch.distributed.checkpoint save over gRPC, keeps them in memory,
on local SSD and on S3, and serves byte ranges back from the fastest tier whose copy verifies.
`ckptd.store` composes a node's store: `ckptd.saves` the save protocol of a node's part (with
`ckptd.names`, `ckptd.datadir`, `ckptd.reads` and `ckptd.replication` for its sections),
`ckptd.cluster` and `ckptd.member` the commit across nodes, `ckptd.holding` the peer copies,
`ckptd.retainer` retention; `ckptd.tiers` the storage, `ckptd.catalog` what is where,
`ckptd.server` and `ckptd.client` the two ends of the wire.
"""
