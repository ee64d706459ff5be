//! Client networks: CIDR lists that `match.clientNetworks` (an exemption,
//! a limit's scope) and the deny list compare the client's address with.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::request::client_ip;

/// A list of IPv4 and IPv6 networks, none inside another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Networks(Vec<IpNet>);

/// Why one entry of a list is refused: its index and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadNetwork {
    pub index: usize,
    pub reason: String,
}

impl Networks {
    /// Parses `a.b.c.d/len` and `x::y/len` (a bare address is its own /32
    /// or /128). Refused: anything else, host bits set (`10.0.0.1/8` is a
    /// typo for `10.0.0.0/8` or for `10.0.0.1/32`: guessing either would
    /// exempt or deny the wrong clients), and two entries that overlap (one
    /// of them is dead or wider than meant: a list that says one thing twice
    /// usually says it wrong once).
    pub fn parse(list: &[String]) -> Result<Networks, BadNetwork> {
        let mut nets: Vec<IpNet> = Vec::with_capacity(list.len());
        for (index, raw) in list.iter().enumerate() {
            let bad = |reason: String| BadNetwork { index, reason };
            let net = match raw.parse::<IpNet>() {
                Ok(net) => net,
                Err(_) => match raw.parse::<IpAddr>() {
                    Ok(addr) => IpNet::from(addr),
                    Err(_) => {
                        return Err(bad(format!(
                            "`{raw}` is not a network: write `192.0.2.0/24`, `2001:db8::/32` or a single address"
                        )))
                    }
                },
            };
            if net.trunc() != net {
                return Err(bad(format!(
                    "`{raw}` has host bits set: write `{}` for the network, or `{}` for the one address",
                    net.trunc(),
                    IpNet::from(net.addr())
                )));
            }
            if let Some(other) = nets
                .iter()
                .position(|n| n.contains(&net) || net.contains(n))
            {
                return Err(bad(format!(
                    "`{raw}` overlaps entry {other} (`{}`): list each network once",
                    nets[other]
                )));
            }
            nets.push(net);
        }
        Ok(Networks(nets))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the client at `address` (Envoy's `source.address`: `ip:port`
    /// or `[ip]:port`) is in one of the networks. An IPv4-mapped IPv6
    /// address is its IPv4 address (a dual-stack listener reports IPv4
    /// clients so). Not an address (a pipe, a missing peer): in none.
    pub fn contains(&self, address: &str) -> bool {
        let Ok(ip) = client_ip(address).parse::<IpAddr>() else {
            return false;
        };
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|n| n.contains(&ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Result<Networks, BadNetwork> {
        Networks::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn ipv4_and_ipv6_networks_contain_their_clients_whatever_the_port() {
        let n = nets(&["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"]).unwrap();
        assert!(n.contains("10.200.3.4:5000"));
        assert!(n.contains("10.0.0.0:1"));
        assert!(!n.contains("11.0.0.1:5000"));
        assert!(n.contains("[2001:db8:ffff::1]:443"));
        assert!(!n.contains("[2001:db9::1]:443"));
        assert!(n.contains("192.0.2.7:80"), "a bare address is its /32");
        assert!(!n.contains("192.0.2.8:80"));
        // A dual-stack listener's view of an IPv4 client.
        assert!(n.contains("[::ffff:10.1.2.3]:80"));
        assert!(!n.contains("not-an-address"));
        assert!(!n.contains(""));
    }

    #[test]
    fn malformed_networks_and_host_bits_are_refused_with_the_fix() {
        for bad in [
            "10.0.0.0/33",
            "10.0.0/8",
            "fe80::/129",
            "office",
            "10.0.0.0/",
            "/8",
        ] {
            let err = nets(&["192.0.2.0/24", bad]).unwrap_err();
            assert_eq!(err.index, 1, "{bad}");
            assert!(err.reason.contains("is not a network"), "{bad}: {err:?}");
        }
        let err = nets(&["10.0.0.1/8"]).unwrap_err();
        assert!(err.reason.contains("`10.0.0.0/8`"), "{err:?}");
        assert!(err.reason.contains("`10.0.0.1/32`"), "{err:?}");
        let err = nets(&["2001:db8::1/32"]).unwrap_err();
        assert!(err.reason.contains("`2001:db8::/32`"), "{err:?}");
    }

    #[test]
    fn overlapping_networks_are_refused_in_either_order() {
        let err = nets(&["10.0.0.0/8", "10.1.0.0/16"]).unwrap_err();
        assert_eq!(err.index, 1);
        assert!(err.reason.contains("overlaps entry 0"), "{err:?}");
        assert_eq!(nets(&["10.1.0.0/16", "10.0.0.0/8"]).unwrap_err().index, 1);
        assert_eq!(nets(&["::/0", "2001:db8::/32"]).unwrap_err().index, 1);
        assert_eq!(nets(&["192.0.2.1", "192.0.2.1/32"]).unwrap_err().index, 1);
        // Neighbours and the two families never overlap.
        assert!(nets(&["10.0.0.0/9", "10.128.0.0/9", "::/0", "192.0.2.0/24"]).is_ok());
    }
}
