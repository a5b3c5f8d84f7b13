"""Checkpoints: a rank's shards in and out, at any (p, t, d, v).

    dcp.py            torch.distributed.checkpoint (DCP) save / load, resharding on load (fxpar.save, fxpar.load)
    chunks.py         a rank's shard of a weight as chunks of the full tensor, the way DCP stores it
    safetensors_io.py Hugging Face save_pretrained directories, read or written by shards
"""
