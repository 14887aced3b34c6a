//! The client's IP address: the peer address by default; behind trusted
//! proxies, the right-most hop of `X-Forwarded-For` (or `Forwarded`) that is
//! not one of them.
//!
//! Why right-most: every proxy *appends* the address it saw, so the hops a
//! client can forge are all to the left of the first hop a trusted proxy
//! wrote. Walking from the right and stopping at the first untrusted hop
//! gives the address the outermost trusted proxy actually saw — a client
//! that sends `X-Forwarded-For: 1.2.3.4` itself only adds a hop further
//! left, which is never read while a real hop sits to its right.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use http::HeaderMap;

/// An IP network in CIDR notation (`10.0.0.0/8`, `fd00::/8`, or one address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// A CIDR that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not an IP network: write an address (10.0.0.1, ::1) or a CIDR (10.0.0.0/8, fd00::/8)")]
pub struct CidrError {
    input: String,
}

impl Cidr {
    /// Whether `ip` lies in this network. An IPv4 network also contains the
    /// IPv4-mapped IPv6 form of its addresses (`::ffff:10.0.0.1`).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask(u32::from(net).into(), u32::from(ip).into(), self.prefix, 32),
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask(u128::from(net), u128::from(ip), self.prefix, 128),
            _ => false,
        }
    }
}

fn mask(net: u128, ip: u128, prefix: u8, bits: u8) -> bool {
    let shift = u32::from(bits - prefix);
    shift >= 128 || (net >> shift) == (ip >> shift)
}

/// IPv4-mapped IPv6 addresses as IPv4 (a dual-stack socket reports them).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, CidrError> {
        let err = || CidrError { input: s.to_owned() };
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let addr = canonical(IpAddr::from_str(addr).map_err(|_| err())?);
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => bits,
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                p.parse::<u8>().ok().filter(|p| *p <= bits).ok_or_else(err)?
            }
            Some(_) => return Err(err()),
        };
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Which header trusted proxies write the client's address into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the de facto standard).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for="[2001:db8::1]:4711"`.
    Forwarded,
}

/// A forwarding header that is not one of the two.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown forwarded header `{0}`: use x-forwarded-for or forwarded")]
pub struct UnknownForwardedHeader(pub String);

impl FromStr for ForwardedHeader {
    type Err = UnknownForwardedHeader;

    fn from_str(s: &str) -> Result<Self, UnknownForwardedHeader> {
        match s.to_ascii_lowercase().as_str() {
            "x-forwarded-for" => Ok(Self::XForwardedFor),
            "forwarded" => Ok(Self::Forwarded),
            _ => Err(UnknownForwardedHeader(s.to_owned())),
        }
    }
}

/// The proxies whose forwarding headers are believed, and which header they
/// write. Empty (the default): the peer address is the client, and no
/// forwarding header is read at all.
///
/// Configure only one header: the one your proxies *append* to. Reading a
/// header they pass through untouched would let clients pick their address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    networks: Vec<Cidr>,
    header: ForwardedHeader,
}

impl TrustedProxies {
    /// Trust `networks`, reading `X-Forwarded-For`.
    pub fn new(networks: impl IntoIterator<Item = Cidr>) -> Self {
        Self { networks: networks.into_iter().collect(), header: ForwardedHeader::default() }
    }

    /// Read `header` instead.
    #[must_use]
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Parse a comma-separated list of CIDRs (`10.0.0.0/8,::1`).
    pub fn parse_list(list: &str) -> Result<Self, CidrError> {
        let networks = list.split(',').filter(|s| !s.trim().is_empty()).map(Cidr::from_str);
        Ok(Self::new(networks.collect::<Result<Vec<_>, _>>()?))
    }

    /// Whether `ip` is a trusted proxy.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.networks.iter().any(|n| n.contains(ip))
    }

    /// The client of a request that arrived from `peer` with `headers`.
    ///
    /// The peer itself unless it is trusted; then the hops of the forwarding
    /// header, right to left: the first one that is not trusted. When every
    /// hop is trusted, the left-most. A hop that does not parse (`unknown`,
    /// an obfuscated `_node`, garbage) ends the walk: the client is then the
    /// trusted hop that handed it on, the last address known to be real.
    #[inline]
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        // No proxy trusted (the default): the peer, without a call.
        if self.networks.is_empty() {
            return peer;
        }
        // The walk's answer comes back as 128 bits in registers: returned
        // as an `IpAddr`, it comes through memory, where the layer's hot path
        // (no proxy trusted) then kept `peer` too, and read it back wider
        // than it was written (a store-forwarding stall of ~10 ns a request).
        canonical(IpAddr::V6(Ipv6Addr::from_bits(self.forwarded_client(peer, headers))))
    }

    /// [`TrustedProxies::client_ip`] past the check for an empty list, as
    /// the bits of an IPv6 address (IPv4 addresses mapped).
    fn forwarded_client(&self, peer: IpAddr, headers: &HeaderMap) -> u128 {
        let bits = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().to_bits(),
            IpAddr::V6(v6) => v6.to_bits(),
        };
        bits(self.walk(peer, headers))
    }

    fn walk(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.contains(peer) {
            return peer;
        }
        let name = match self.header {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        };
        // Several header lines are one list, in order (RFC 9110 5.3).
        let values: Vec<&str> = headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
        let mut client = peer;
        for hop in values.iter().rev().flat_map(|v| v.rsplit(',')) {
            let parsed = match self.header {
                ForwardedHeader::XForwardedFor => parse_xff_hop(hop),
                ForwardedHeader::Forwarded => parse_forwarded_for(hop),
            };
            let Some(ip) = parsed.map(canonical) else { return client };
            client = ip;
            if !self.contains(ip) {
                return ip;
            }
        }
        client
    }
}

/// One `X-Forwarded-For` hop: an address, maybe with a port
/// (`1.2.3.4:80`, `[::1]:80`) as some proxies write it.
fn parse_xff_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    parse_node(hop)
}

/// The `for=` of one `Forwarded` element (`for=1.2.3.4;proto=https`).
fn parse_forwarded_for(element: &str) -> Option<IpAddr> {
    let value = element.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        k.trim().eq_ignore_ascii_case("for").then_some(v.trim())
    })?;
    parse_node(value.trim_matches('"'))
}

/// An address, `addr:port` or `[v6]:port`.
fn parse_node(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = IpAddr::from_str(s) {
        return Some(ip);
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (v6, _) = rest.split_once(']')?;
        return Ipv6Addr::from_str(v6).ok().map(IpAddr::V6);
    }
    let (v4, port) = s.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    Ipv4Addr::from_str(v4).ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn headers(name: &'static str, values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(name, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn cidrs_parse_and_contain() {
        let net: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains(ip("10.255.0.1")) && !net.contains(ip("11.0.0.1")));
        assert!(net.contains(ip("::ffff:10.1.2.3")), "mapped v4 is v4");
        let one: Cidr = "192.168.1.7".parse().unwrap();
        assert!(one.contains(ip("192.168.1.7")) && !one.contains(ip("192.168.1.8")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")) && !all.contains(ip("::1")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!("::/0".parse::<Cidr>().unwrap().contains(ip("2001:db8::1")));
        for bad in ["10.0.0.0/33", "10.0.0/8", "x", "10.0.0.0/", "10.0.0.0/-1", "::/129", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert!(TrustedProxies::parse_list("10.0.0.0/8, ::1").is_ok());
        let e = TrustedProxies::parse_list("10.0.0.0/8,nope").unwrap_err();
        assert!(e.to_string().contains("`nope` is not an IP network"), "{e}");
    }

    #[test]
    fn untrusted_peers_are_the_client_whatever_they_send() {
        let t = TrustedProxies::parse_list("10.0.0.0/8").unwrap();
        let h = headers("x-forwarded-for", &["1.1.1.1"]);
        assert_eq!(t.client_ip(ip("203.0.113.9"), &h), ip("203.0.113.9"));
        // No trusted proxies: headers are never read.
        assert_eq!(TrustedProxies::default().client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }

    #[test]
    fn the_right_most_untrusted_hop_is_the_client() {
        let t = TrustedProxies::parse_list("10.0.0.0/8").unwrap();
        // The client forged 6.6.6.6; the trusted proxy appended what it saw.
        let h = headers("x-forwarded-for", &["6.6.6.6, 203.0.113.9", "10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("203.0.113.9"));
        // Every hop trusted: the left-most.
        let h = headers("x-forwarded-for", &["10.0.0.3,10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.3"));
        // No header: the trusted peer itself.
        assert_eq!(t.client_ip(ip("10.0.0.1"), &HeaderMap::new()), ip("10.0.0.1"));
        // Garbage stops the walk at the trusted hop that handed it on.
        let h = headers("x-forwarded-for", &["203.0.113.9, garbage, 10.0.0.2"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.2"));
        // Ports and brackets as some proxies write them.
        let h = headers("x-forwarded-for", &["[2001:db8::1]:443, 198.51.100.4:80"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("198.51.100.4"));
    }

    #[test]
    fn addresses_keep_their_family_through_the_walk() {
        // The walk hands its answer back as IPv6 bits: each family must
        // come out as it went in.
        let t = TrustedProxies::parse_list("10.0.0.0/8, 2001:db8::/32").unwrap();
        let cases = [
            ("203.0.113.9", "203.0.113.9"),
            ("2001:db9::1", "2001:db9::1"),
            // IPv4-mapped: the IPv4 client, as a dual-stack socket means it.
            ("::ffff:203.0.113.9", "203.0.113.9"),
            // IPv4-compatible (deprecated) stays IPv6, as does `::`.
            ("::203.0.113.9", "::203.0.113.9"),
            ("::", "::"),
            ("0.0.0.0", "0.0.0.0"),
        ];
        for (hop, client) in cases {
            let h = headers("x-forwarded-for", &[hop]);
            for peer in ["10.0.0.1", "2001:db8::2", "::ffff:10.0.0.1"] {
                assert_eq!(t.client_ip(ip(peer), &h), ip(client), "{hop} via {peer}");
            }
        }
        // A trusted peer with no header is itself, in its own family.
        assert_eq!(t.client_ip(ip("2001:db8::2"), &HeaderMap::new()), ip("2001:db8::2"));
        assert_eq!(t.client_ip(ip("::ffff:10.0.0.1"), &HeaderMap::new()), ip("10.0.0.1"));
    }

    #[test]
    fn forwarded_is_read_only_when_configured() {
        let t = TrustedProxies::parse_list("10.0.0.0/8").unwrap().header(ForwardedHeader::Forwarded);
        let h = headers("forwarded", &["for=6.6.6.6, for=\"[2001:db8::17]:4711\";proto=https", "for=10.0.0.2;by=x"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("2001:db8::17"));
        // X-Forwarded-For is ignored when Forwarded is the configured header.
        let h = headers("x-forwarded-for", &["1.2.3.4"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
        let h = headers("forwarded", &["for=unknown"]);
        assert_eq!(t.client_ip(ip("10.0.0.1"), &h), ip("10.0.0.1"));
    }
}
