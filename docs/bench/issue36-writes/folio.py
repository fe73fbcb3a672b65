#!/usr/bin/env python3
"""CPU per GB of 256 KiB pwrites on a file in $TMPDIR (ext4 /tmp here), with and without a 36-byte
pwrite before each (the read-ahead's own write before eb7da15), on layouts written either way."""
import os, time, resource
D=os.environ.get("TMPDIR", "/tmp")
N=1<<30; bs=256<<10; buf=os.urandom(bs)
def cpu(): r=resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime+r.ru_stime
def fill(path, tiny):
    fd=os.open(path, os.O_RDWR|os.O_CREAT|os.O_TRUNC); os.ftruncate(fd,N)
    for off in range(0,N,bs):
        if tiny: os.pwrite(fd, buf[:tiny], off)
        os.pwrite(fd, buf[tiny:], off+tiny)
    return fd
def timed(fd, tiny):
    t=cpu()
    for off in range(0,N,bs):
        if tiny: os.pwrite(fd, buf[:tiny], off)
        os.pwrite(fd, buf[tiny:], off+tiny)
    return cpu()-t
for layout in (0,36):
    fd=fill(os.path.join(D, 'f%d.img'%layout), layout)
    for pat in (0,36,0,36):
        print("layout made with tiny=%d, writes with tiny=%d: %.3f s/GB"%(layout,pat,timed(fd,pat)))
    os.close(fd); os.unlink(os.path.join(D, 'f%d.img'%layout))
