//! Test frame builder: Ethernet (+VLAN) / IPv4|IPv6 / TCP|UDP with checksums computed from
//! scratch, and a checksum verifier for frames the program rewrote.
use std::net::IpAddr;

use loxi_common::maps::proto;

/// One test frame.
#[derive(Debug, Clone)]
pub struct Frame {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub vlan: Option<u16>,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
}

pub const MAC_CLIENT: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const MAC_LB: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;

impl Frame {
    /// A TCP segment (flags `SYN`) client → `dst:dport` with a 12-byte payload.
    pub fn tcp(src: &str, sport: u16, dst: &str, dport: u16) -> Self {
        Self {
            dmac: MAC_LB,
            smac: MAC_CLIENT,
            vlan: None,
            src: src.parse().expect("test address"),
            dst: dst.parse().expect("test address"),
            proto: proto::TCP,
            sport,
            dport,
            tcp_flags: SYN,
            payload: b"hello, loxi!".to_vec(),
        }
    }

    /// A UDP datagram with a 12-byte payload.
    pub fn udp(src: &str, sport: u16, dst: &str, dport: u16) -> Self {
        Self {
            proto: proto::UDP,
            tcp_flags: 0,
            ..Self::tcp(src, sport, dst, dport)
        }
    }

    /// Same frame with other addresses/ports (for expected outputs).
    pub fn with(&self, src: &str, sport: u16, dst: &str, dport: u16) -> Self {
        Self {
            src: src.parse().expect("test address"),
            dst: dst.parse().expect("test address"),
            sport,
            dport,
            ..self.clone()
        }
    }

    /// Wire bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let l4 = self.l4_bytes();
        let mut out = Vec::new();
        out.extend_from_slice(&self.dmac);
        out.extend_from_slice(&self.smac);
        if let Some(tag) = self.vlan {
            out.extend_from_slice(&0x8100u16.to_be_bytes());
            out.extend_from_slice(&tag.to_be_bytes());
        }
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                out.extend_from_slice(&0x0800u16.to_be_bytes());
                let mut h = vec![0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, self.proto, 0, 0];
                h[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                let c = checksum(&h, 0);
                h[10..12].copy_from_slice(&c.to_be_bytes());
                out.extend_from_slice(&h);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                out.extend_from_slice(&0x86DDu16.to_be_bytes());
                out.extend_from_slice(&[0x60, 0, 0, 0]);
                out.extend_from_slice(&(l4.len() as u16).to_be_bytes());
                out.extend_from_slice(&[self.proto, 64]);
                out.extend_from_slice(&s.octets());
                out.extend_from_slice(&d.octets());
            }
            _ => panic!("mixed address families in a test frame"),
        }
        out.extend_from_slice(&l4);
        out
    }

    fn l4_bytes(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.sport.to_be_bytes());
        l4.extend_from_slice(&self.dport.to_be_bytes());
        let csum_at = if self.proto == proto::TCP {
            l4.extend_from_slice(&1000u32.to_be_bytes());
            l4.extend_from_slice(&0u32.to_be_bytes());
            l4.extend_from_slice(&[0x50, self.tcp_flags, 0xff, 0xff, 0, 0, 0, 0]);
            16
        } else {
            l4.extend_from_slice(&((8 + self.payload.len()) as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
            6
        };
        l4.extend_from_slice(&self.payload);
        let c = checksum(&l4, pseudo(self.src, self.dst, self.proto, l4.len()));
        let c = if c == 0 && self.proto == proto::UDP {
            0xffff
        } else {
            c
        };
        l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        l4
    }
}

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for ch in data.chunks(2) {
        let w = if ch.len() == 2 {
            u16::from_be_bytes([ch[0], ch[1]])
        } else {
            u16::from_be_bytes([ch[0], 0])
        };
        acc += w as u32;
    }
    acc
}

fn pseudo(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u32 {
    let mut acc = 0;
    for a in [src, dst] {
        acc = match a {
            IpAddr::V4(v) => sum16(&v.octets(), acc),
            IpAddr::V6(v) => sum16(&v.octets(), acc),
        };
    }
    acc + proto as u32 + len as u32
}

/// Internet checksum of `data` with a starting partial sum.
pub fn checksum(data: &[u8], start: u32) -> u16 {
    let mut s = sum16(data, start);
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}
