//! The one error type of smartstore. Every variant names what failed: the
//! node (by role and address), the file, or the plan fragment, so an operator
//! can act on it without reading code. A lost node ([`Error::NodeLost`];
//! on the node itself, [`Error::StorageLost`]) is the fault of section 3
//! of the smart-storage paper, which the host tells apart from every other
//! error to recover from it.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, and where.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A node could not be reached, or answered with an error.
    #[error("node {node}: {message}")]
    Node {
        /// The node, as `role index (address)`.
        node: String,
        /// What the node said, or why it could not be reached.
        message: String,
    },
    /// A node is lost: its process does not answer, or its storage is gone
    /// (section 3's fault: "D1 of SDG A malfunctions midstream").
    #[error("node {node} lost: {message}")]
    NodeLost {
        /// The node, as `role index (address)`.
        node: String,
        /// How the loss showed.
        message: String,
    },
    /// This node's own storage directory cannot be read (the node-side
    /// form of a lost node).
    #[error("storage unavailable: {}: {message}", path.display())]
    StorageLost {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A stored object (partition, checkpoint, parity) is damaged.
    #[error("{}: {message}", path.display())]
    Object {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// I/O on a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A plan fragment was malformed or names something that does not exist.
    #[error("plan fragment: {0}")]
    Plan(String),
    /// A request outside what the system accepts (scale factor, node count, ...).
    #[error("{0}")]
    Invalid(String),
    /// A request this node's access rules forbid (a transfer to an address
    /// outside the cluster's members).
    #[error("refused: {0}")]
    Refused(String),
    /// Arrow failed to encode or decode data.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// DataFusion failed to execute an operator.
    #[error("datafusion: {0}")]
    DataFusion(#[from] datafusion::error::DataFusionError),
    /// The redundancy layout could not rebuild the data.
    #[error("redundancy: {0}")]
    Redundancy(String),
}

impl From<redundancy::Error> for Error {
    fn from(e: redundancy::Error) -> Self {
        Error::Redundancy(e.0)
    }
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A damaged object at `path`.
    pub fn object(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Object {
            path: path.into(),
            message: message.into(),
        }
    }

    /// An error attributed to `node`.
    pub fn node(node: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Error::Node {
            node: node.into(),
            message: message.to_string(),
        }
    }
}

impl Error {
    /// Whether this error means a node is lost (the recovery schemes'
    /// trigger), as opposed to a bad request or damaged data.
    pub fn is_node_lost(&self) -> bool {
        matches!(self, Error::NodeLost { .. })
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        match &e {
            Error::Plan(_) | Error::Invalid(_) => tonic::Status::invalid_argument(e.to_string()),
            Error::Refused(_) => tonic::Status::permission_denied(e.to_string()),
            Error::Object { .. } => tonic::Status::data_loss(e.to_string()),
            Error::StorageLost { .. } => tonic::Status::unavailable(e.to_string()),
            _ => tonic::Status::internal(e.to_string()),
        }
    }
}
