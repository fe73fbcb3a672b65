//! The peer process of `tests/interop.rs`'s kill test: connects a QP to the address given
//! as its argument and streams 1 MiB messages both ways until it is killed. It prints
//! "streaming" once its work requests are posted.

use qpip_core::{Access, Completion, Nic, Opcode, QpAttr, RecvWr, SendWr};

fn main() {
    let target = std::env::args()
        .nth(1)
        .expect("usage: qp_stream_peer ADDR:PORT");
    let nic = Nic::soft().unwrap();
    let cq = nic.create_cq(64);
    let qp = nic.create_qp(QpAttr::new(&cq).depths(16, 16));
    qp.connect(target.parse().expect("a socket address"))
        .unwrap();
    let mr = nic.alloc_region(32 << 20, Access::READ_WRITE);
    for i in 0..16 {
        qp.post_recv(RecvWr::new(i, &[mr.sge(i as usize * (1 << 20), 1 << 20)]))
            .unwrap();
    }
    for i in 0..8 {
        qp.post_send(SendWr::new(100 + i, &[mr.sge(16 << 20, 1 << 20)]))
            .unwrap();
    }
    println!("streaming");
    let mut buf = [Completion::default(); 32];
    loop {
        let n = cq.wait(&mut buf, None).unwrap();
        for c in &buf[..n] {
            match c.opcode {
                Opcode::Recv => qp.post_recv(RecvWr::new(
                    c.wr_id,
                    &[mr.sge(c.wr_id as usize * (1 << 20), 1 << 20)],
                )),
                Opcode::Send => qp.post_send(SendWr::new(c.wr_id, &[mr.sge(16 << 20, 1 << 20)])),
            }
            .unwrap();
        }
    }
}
