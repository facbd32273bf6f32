//! systemd socket activation: the listening sockets a service manager opened for us and named in
//! `LISTEN_PID`, `LISTEN_PIDFDID`, `LISTEN_FDS` and `LISTEN_FDNAMES`, checked and taken once.
//!
//! ```text
//! systemd: socket(), bind(), listen() ── fork ── exec us with fds 3, 4, ... and LISTEN_* set
//! us:      listeners() ── is LISTEN_PID (and LISTEN_PIDFDID, if set) us? no ──> nothing, variables left alone
//!                        └─ yes: parse LISTEN_FDS (at most 64), make every passed fd close-on-exec,
//!                           parse LISTEN_FDNAMES, check every fd (open, SO_TYPE stream, SO_ACCEPTCONN,
//!                           IP address), then take them all or none, and clear the variables so our
//!                           children do not take them again
//! ```

use std::net::SocketAddr;

use net_io_sys::inherit::{self, FIRST_INHERITED, INHERITED_MAX, Unfit};
use net_io_sys::socket::Listener;

/// A listening socket inherited from the service manager, taken by this process.
#[derive(Debug)]
pub struct InheritedListener {
    pub(crate) listener: Listener,
    fd: i32,
    name: Option<String>,
}

/// Why the inherited sockets could not be adopted. Nothing was taken when this is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SystemdError {
    /// `LISTEN_PID` is set but is not a process id.
    #[error(
        "LISTEN_PID is {value:?}, which is not a process id; fix the service manager's setting or unset it"
    )]
    Pid {
        /// The variable's value.
        value: String,
    },
    /// `LISTEN_FDS` is missing or not a count while `LISTEN_PID` names us.
    #[error(
        "LISTEN_FDS is {value:?}, which is not a count of descriptors; set it to the number of sockets passed"
    )]
    Count {
        /// The variable's value (empty when missing).
        value: String,
    },
    /// `LISTEN_FDS` asks for more sockets than we take.
    #[error(
        "LISTEN_FDS is {count}, above the limit of {max} inherited listeners; pass fewer sockets"
    )]
    TooMany {
        /// The count asked for.
        count: u64,
        /// The limit.
        max: usize,
    },
    /// `LISTEN_FDNAMES` does not give one name per socket.
    #[error(
        "LISTEN_FDNAMES has {names} names but LISTEN_FDS is {count}; give one name per socket (FileDescriptorName=)"
    )]
    Names {
        /// How many names the variable holds.
        names: usize,
        /// How many sockets `LISTEN_FDS` counts.
        count: usize,
    },
    /// An inherited descriptor is not a listening TCP socket we can take.
    #[error(
        "inherited fd {fd} (named {name:?}) cannot be adopted: {problem}; pass listening TCP stream sockets only (ListenStream=)"
    )]
    Unfit {
        /// The descriptor number.
        fd: i32,
        /// Its name from `LISTEN_FDNAMES`, or `unknown` when none was given.
        name: String,
        /// What is wrong with it.
        problem: Unfit,
    },
}

impl InheritedListener {
    /// The descriptor number it was inherited under.
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// Its name from `LISTEN_FDNAMES` (`FileDescriptorName=`), if the manager gave names.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr()
    }
}

/// Takes the listening sockets systemd passed to this process, in descriptor order.
///
/// Returns an empty list when `LISTEN_PID` is unset or names another process (or `LISTEN_PIDFDID` names
/// another process that reused our pid): those variables are left alone, they are not ours. When they are
/// ours, every passed descriptor is first made close-on-exec (as `sd_listen_fds(3)` does), then every one is
/// checked before any is taken, and the variables are removed whether or not the checks pass. On a failure
/// none is taken: the passed descriptors stay open but close-on-exec, so no child of this process inherits
/// them. Call it early, before starting threads that call C `getenv` (see
/// [`net_io_sys::inherit::clear_activation_variables`]).
pub fn listeners() -> Result<Vec<InheritedListener>, SystemdError> {
    let Some(pid) = std::env::var_os("LISTEN_PID") else {
        return Ok(Vec::new());
    };
    let pid = pid.to_string_lossy().into_owned();
    let Ok(pid_number) = pid.trim().parse::<u32>() else {
        return Err(SystemdError::Pid { value: pid });
    };
    if pid_number != std::process::id() || !pidfd_id_is_ours() {
        return Ok(Vec::new());
    }
    let taken = take_all();
    inherit::clear_activation_variables();
    taken
}

/// False only when `LISTEN_PIDFDID` is set, readable, and differs from our own pidfd's id. Without the
/// variable, or on a kernel that cannot tell, `LISTEN_PID` alone decides, as it did before systemd 254.
fn pidfd_id_is_ours() -> bool {
    let Some(expected) = std::env::var("LISTEN_PIDFDID")
        .ok()
        .and_then(|value| value.trim().parse::<u64>().ok())
    else {
        return true;
    };
    inherit::own_pidfd_id().map_or(true, |ours| ours == expected)
}

/// Parses `LISTEN_FDS` and `LISTEN_FDNAMES`, checks every descriptor, then takes them all.
fn take_all() -> Result<Vec<InheritedListener>, SystemdError> {
    let value = std::env::var("LISTEN_FDS").unwrap_or_default();
    let Ok(count) = value.trim().parse::<u64>() else {
        return Err(SystemdError::Count { value });
    };
    // As sd_listen_fds(3) does: every passed descriptor becomes close-on-exec before anything else is
    // checked, so whatever the checks below find, none of them leaks into a child this process starts. A
    // count above the limit is not trusted, but the numbers up to the limit are ours all the same.
    let passed = count.min(INHERITED_MAX as u64) as usize;
    let mut unmarked = None;
    for offset in 0..passed {
        let fd = FIRST_INHERITED + offset as i32;
        match inherit::set_close_on_exec(fd) {
            // Not open, or taken already: the checks below report those by number and name.
            Ok(()) | Err(Unfit::NotOpen | Unfit::AlreadyTaken) => {}
            Err(problem) => {
                unmarked.get_or_insert((fd, offset, problem));
            }
        }
    }
    if count > INHERITED_MAX as u64 {
        return Err(SystemdError::TooMany {
            count,
            max: INHERITED_MAX,
        });
    }
    let count = count as usize;
    let names: Option<Vec<String>> = std::env::var("LISTEN_FDNAMES").ok().map(|names| match names
        .as_str()
    {
        "" => Vec::new(),
        names => names.split(':').map(str::to_owned).collect(),
    });
    if let Some(names) = &names
        && names.len() != count
    {
        return Err(SystemdError::Names {
            names: names.len(),
            count,
        });
    }
    let name_of = |offset: usize| names.as_ref().map(|names| names[offset].clone());
    let unfit = |fd: i32, offset: usize, problem: Unfit| SystemdError::Unfit {
        fd,
        name: name_of(offset).unwrap_or_else(|| "unknown".to_owned()),
        problem,
    };
    if let Some((fd, offset, problem)) = unmarked {
        return Err(unfit(fd, offset, problem));
    }
    // All or nothing: a bad descriptor anywhere leaves every one of them where it was (close-on-exec now).
    for offset in 0..count {
        let fd = FIRST_INHERITED + offset as i32;
        inherit::check_listener(fd).map_err(|problem| unfit(fd, offset, problem))?;
    }
    // Should a take fail half-way (a system call failing after the checks passed), `taken` is dropped on
    // the way out, which closes exactly the descriptors this process took and no other.
    let mut taken = Vec::with_capacity(count);
    for offset in 0..count {
        let fd = FIRST_INHERITED + offset as i32;
        let listener = inherit::take_listener(fd).map_err(|problem| unfit(fd, offset, problem))?;
        taken.push(InheritedListener {
            listener,
            fd,
            name: name_of(offset),
        });
    }
    Ok(taken)
}
