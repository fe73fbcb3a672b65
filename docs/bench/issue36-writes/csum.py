#!/usr/bin/env python3
"""csum.py OUT [REQUESTS]: medians per link and build of counts3.sh's runs: MB/s, server and fio CPU per GB
(fio's from its job usr+sys), and per request (default 16384 = 4 GiB / 256 KiB) context switches,
splices, epoll_waits, readv, writev, pwrite64, setsockopt of the server, and fio's context switches."""
import sys, glob, os, json, statistics, collections
out=sys.argv[1]; reqs=float(sys.argv[2]) if len(sys.argv)>2 else 16384
def load(path):
    d=collections.defaultdict(dict)
    for l in open(path):
        if l.startswith('#') or not l.strip(): continue
        f=l.strip().split(',')
        if len(f)<4: continue
        try: v=float(f[1])
        except: continue
        d[f[0]][f[3].replace('syscalls:sys_enter_','')]=v
    return d
res=collections.defaultdict(list)
for d in sorted(glob.glob(out+'/*-*-*')):
    if d.endswith('.mbs') or os.path.basename(d).startswith('load'): continue
    link,which,r=os.path.basename(d).split('-')
    s=load(d+'/srv-stat.txt'); tot=collections.Counter()
    for th,ev in s.items():
        for k,v in ev.items(): tot[k]+=v
    f=load(d+'/fio-stat.txt'); fio=collections.Counter()
    for th,ev in f.items():
        for k,v in ev.items(): fio[k]+=v
    t=open(d+'/fio.json').read(); j=json.loads(t[t.index('{'):])['jobs'][0]
    rw='read' if j['read']['io_bytes'] else 'write'; gb=j[rw]['io_bytes']/1e9
    res[(link,which)].append(dict(mbs=j[rw]['bw_bytes']/1e6, srv=tot['task-clock']/1e3/gb, fio_job=(j['usr_cpu']+j['sys_cpu'])/100*j[rw]['runtime']/1e3/gb,
        cs=tot['context-switches']/reqs, spl=tot['splice']/reqs, ep=tot['epoll_wait']/reqs, rv=tot['readv']/reqs, wv=tot['writev']/reqs, pw=tot['pwrite64']/reqs, ss=tot['setsockopt']/reqs, fiocs=j['ctx']/reqs))
keys=['mbs','srv','fio_job','cs','spl','ep','rv','wv','pw','ss','fiocs']
print("%-18s"%"", " ".join("%9s"%k for k in keys))
for k,v in sorted(res.items()):
    print("%-18s"%("%s %s"%k), " ".join("%9.3g"%statistics.median(x[c] for x in v) for c in keys), " mbs:",[round(x['mbs']) for x in v])
