# stampsum.py DIR: per build (files BUILD-RUN.txt of `micro --only qp-tcp` with stamps.patch
# applied), the median over runs of each step's mean time, with the steps named.
import re, sys, glob, statistics as st, collections
NAMES = {
    "0->1": "socket read returns the message -> its completion is pushed (rx machine, placement)",
    "1->2": "completion pushed -> CQ notified (fence, wake check)",
    "2->3": "notified -> turn ends, back in run_turns",
    "3->4": "the pace learns of the work (a clock reading)",
    "4->5": "next turn: commands, doorbells",
    "5->13": "done() says the CQ has news",
    "13->14": "run_turns returns (drive_host)",
    "14->15": "the window kept, CPU accounting",
    "15->16": "engine lock let go",
    "16->17": "drive end recorded for the NIC thread (a clock reading before the change)",
    "17->18": "fence",
    "18->19": "leave rules",
    "19->20": "drive returns to the CQ's wait",
    "20->21": "wait returns to the application",
    "21->22": "application posts the next receive (ring, doorbell)",
    "22->23": "application posts the echo's send",
    "23->24": "application waits again: drive begins, doorbell taken",
    "24->25": "commands run before the doorbell",
    "25->26": "the engine's doorbell: QP looked up, flag cleared",
    "26->27": "send WR taken: SGE resolved, header framed",
    "27->28": "transmit pump reaches writev",
}
d = collections.defaultdict(lambda: collections.defaultdict(list))
rt = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.txt")):
    tag = f.split("/")[-1].rsplit("-", 1)[0]
    for l in open(f):
        m = re.match(r"stamp (\d+->\d+): n=\d+ mean (\d+) ns", l)
        if m:
            d[tag][m[1]].append(int(m[2]))
        m = re.search(r"round trip ([\d.]+) µs", l)
        if m:
            rt[tag].append(float(m[1]))
tags = sorted(d)
print("| step | " + " | ".join(tags) + " |")
print("|---|" + "---:|" * len(tags))
total = {t: 0 for t in tags}
for k, name in NAMES.items():
    cells = []
    for t in tags:
        v = st.median(d[t][k]) if d[t][k] else float("nan")
        total[t] += v
        cells.append(f"{v:.0f}")
    print(f"| {k} {name} | " + " | ".join(cells) + " |")
print("| sum, ns (each step includes one stamp, ~9 ns) | " + " | ".join(f"{total[t]:.0f}" for t in tags) + " |")
print("| round trip, µs (median) | " + " | ".join(f"{st.median(rt[t]):.2f}" for t in tags) + " |")
