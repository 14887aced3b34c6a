//! The protocol adapters: each translates its protocol to the
//! [`service`](crate::service)'s requests and the answers back, and holds
//! no policy of its own.

pub mod admin;
pub mod budget;
pub mod budget_grpc;
pub mod grpc;
pub mod http;
pub mod json;
pub mod leases_grpc;
pub mod unary;
