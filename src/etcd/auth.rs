//! The `Auth` service on leasecore's users and roles: every RPC calls the `/v1/auth/...`
//! handler that does the same thing (`http::auth`), so checks (root only, names, password
//! bounds), hashing and proposals are theirs, and both APIs change the same replicated state.
//! `etcdctl user|role|auth` work as against etcd.
//!
//! # Mapping
//! - Permissions: etcd's key ranges map onto leasecore's key and prefix grants as
//!   [`super::permission`] says; a range leasecore cannot hold is refused (`InvalidArgument`).
//! - Errors are etcd's (`etcdserver: user name already exists`, `... role name not found`,
//!   `... root user does not exist`, `... root user does not have root role` (on which
//!   `etcdctl auth enable` adds the role itself), `... invalid auth management` for the root
//!   user or role while auth is on, `... permission denied` for a non-root caller).
//! - `root` is built in: granting it needs no `RoleAdd` (as in etcd), and `RoleGet` shows it
//!   allowing everything. It exists while it was added or a user holds it (etcd's only once
//!   added): `RoleList` lists it, and `RoleDelete` (refused while auth is on, `invalid auth
//!   management`, as etcd's) deletes it and takes it from every user, as etcd's does.
//!
//! # Differences from etcd
//! - Users have passwords: `UserAdd` with `no_password` (etcd's users that authenticate by TLS
//!   certificate only) is refused, and so is an empty password.
//! - `UserGet` and `RoleGet` are root-only, as `/v1`'s (etcd also lets a user read itself and
//!   its own roles).
//! - Changing a password or deleting a user does not revoke tokens already issued before their
//!   expiry (`--auth-token-ttl`), except that a deleted user's tokens stop working at once.
//!
//! # What it must not do
//! Check a password or a permission itself: the auth runtime and the domain do.

use axum::Json;
use axum::extract::State;
use leasecore_etcd_api::etcdserverpb::auth_server::Auth;
use leasecore_etcd_api::etcdserverpb::{
    AuthDisableRequest, AuthDisableResponse, AuthEnableRequest, AuthEnableResponse,
    AuthRoleAddRequest, AuthRoleAddResponse, AuthRoleDeleteRequest, AuthRoleDeleteResponse,
    AuthRoleGetRequest, AuthRoleGetResponse, AuthRoleGrantPermissionRequest,
    AuthRoleGrantPermissionResponse, AuthRoleListRequest, AuthRoleListResponse,
    AuthRoleRevokePermissionRequest, AuthRoleRevokePermissionResponse, AuthStatusRequest,
    AuthStatusResponse, AuthUserAddRequest, AuthUserAddResponse, AuthUserChangePasswordRequest,
    AuthUserChangePasswordResponse, AuthUserDeleteRequest, AuthUserDeleteResponse,
    AuthUserGetRequest, AuthUserGetResponse, AuthUserGrantRoleRequest, AuthUserGrantRoleResponse,
    AuthUserListRequest, AuthUserListResponse, AuthUserRevokeRoleRequest,
    AuthUserRevokeRoleResponse, AuthenticateRequest, AuthenticateResponse,
};
use tonic::{Request, Response, Status};

use super::permission::{self, INVALID_AUTH_MGMT};
use super::{Etcd, EtcdError};
use crate::domain::auth::ROOT;
use crate::http::auth as v1;
use crate::http::error::ApiError;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::wire::{Credentials, PasswordRequest, RoleRequest};

/// An answer of a `/v1` handler, in etcd's words.
fn etcd<T>(r: Result<T, ApiError>) -> Result<T, Status> {
    r.map_err(|e| EtcdError::from(e).into())
}

/// Whether a `/v1` change was applied (its answer's document is not needed), in etcd's words.
fn applied<T>(r: Result<T, ApiError>) -> Result<(), Status> {
    etcd(r).map(drop)
}

/// A change the domain refuses for the root user or role while auth is on (leasecore's
/// message; etcd's is `ErrGRPCInvalidAuthMgmt`, which clients match).
fn root_protected<T>(about_root: bool, r: Result<T, ApiError>) -> Result<(), Status> {
    r.map(drop).map_err(|e| {
        if about_root && e.code == "invalid_argument" {
            Status::invalid_argument(INVALID_AUTH_MGMT)
        } else {
            EtcdError::from(e).into()
        }
    })
}

fn empty(what: &str) -> Status {
    Status::invalid_argument(format!("etcdserver: {what} name is empty"))
}

#[tonic::async_trait]
impl Auth for Etcd {
    async fn authenticate(
        &self,
        req: Request<AuthenticateRequest>,
    ) -> Result<Response<AuthenticateResponse>, Status> {
        let r = req.into_inner();
        let state = &self.state;
        // Linearizable, as `/v1`: a user added before this call is seen on any node.
        state
            .consensus
            .read_barrier()
            .await
            .map_err(EtcdError::from)?;
        let (token, _) = state
            .auth
            .authenticate(&r.name, &r.password)
            .await
            .map_err(|e| match e {
                // etcd's answer to a wrong name or password (clients match it).
                crate::runtime::auth::AccessError::Unauthenticated(_) => {
                    EtcdError::Status(Status::invalid_argument(
                        "etcdserver: authentication failed, invalid user ID or password",
                    ))
                }
                other => EtcdError::from(other),
            })?;
        Ok(Response::new(AuthenticateResponse {
            header: self.header(),
            token,
        }))
    }

    async fn auth_enable(
        &self,
        req: Request<AuthEnableRequest>,
    ) -> Result<Response<AuthEnableResponse>, Status> {
        let caller = self.caller(&req)?;
        v1::enable(State(self.state.clone()), caller)
            .await
            .map(drop)
            .map_err(|e| {
                if e.code != "root_user_required" {
                    return EtcdError::from(e).into();
                }
                // etcd tells the two apart: etcdctl answers the second by adding the role.
                let has_root = self.state.auth.with_auth(|a| a.users.contains_key(ROOT));
                Status::failed_precondition(if has_root {
                    "etcdserver: root user does not have root role"
                } else {
                    "etcdserver: root user does not exist"
                })
            })?;
        Ok(Response::new(AuthEnableResponse {
            header: self.header(),
        }))
    }

    async fn auth_disable(
        &self,
        req: Request<AuthDisableRequest>,
    ) -> Result<Response<AuthDisableResponse>, Status> {
        let caller = self.caller(&req)?;
        applied(v1::disable(State(self.state.clone()), caller).await)?;
        Ok(Response::new(AuthDisableResponse {
            header: self.header(),
        }))
    }

    async fn auth_status(
        &self,
        _req: Request<AuthStatusRequest>,
    ) -> Result<Response<AuthStatusResponse>, Status> {
        // Open, as `GET /v1/auth/status` (it tells whether a token is needed at all).
        let Json(status) = v1::status(State(self.state.clone())).await;
        Ok(Response::new(AuthStatusResponse {
            header: self.header(),
            enabled: status.enabled,
            auth_revision: status.auth_revision,
        }))
    }

    async fn user_add(
        &self,
        req: Request<AuthUserAddRequest>,
    ) -> Result<Response<AuthUserAddResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        if r.name.is_empty() {
            return Err(empty("user"));
        }
        if r.options.is_some_and(|o| o.no_password) {
            return Err(EtcdError::invalid(
                "leasecore users authenticate by password: a user without one (--no-password) \
                 is not supported",
            )
            .into());
        }
        let creds = Credentials {
            name: r.name,
            password: r.password,
        };
        applied(v1::user_add(State(self.state.clone()), caller, ApiJson(creds)).await)?;
        Ok(Response::new(AuthUserAddResponse {
            header: self.header(),
        }))
    }

    async fn user_get(
        &self,
        req: Request<AuthUserGetRequest>,
    ) -> Result<Response<AuthUserGetResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = req.into_inner().name;
        let Json(user) =
            etcd(v1::user_get(State(self.state.clone()), caller, ApiPath(name)).await)?;
        Ok(Response::new(AuthUserGetResponse {
            header: self.header(),
            roles: user.roles,
        }))
    }

    async fn user_list(
        &self,
        req: Request<AuthUserListRequest>,
    ) -> Result<Response<AuthUserListResponse>, Status> {
        let caller = self.caller(&req)?;
        let Json(list) = etcd(v1::user_list(State(self.state.clone()), caller).await)?;
        Ok(Response::new(AuthUserListResponse {
            header: self.header(),
            users: list.users,
        }))
    }

    async fn user_delete(
        &self,
        req: Request<AuthUserDeleteRequest>,
    ) -> Result<Response<AuthUserDeleteResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = req.into_inner().name;
        let about_root = name == ROOT;
        let done = v1::user_delete(State(self.state.clone()), caller, ApiPath(name)).await;
        root_protected(about_root, done)?;
        Ok(Response::new(AuthUserDeleteResponse {
            header: self.header(),
        }))
    }

    async fn user_change_password(
        &self,
        req: Request<AuthUserChangePasswordRequest>,
    ) -> Result<Response<AuthUserChangePasswordResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let body = ApiJson(PasswordRequest {
            password: r.password,
        });
        applied(v1::user_passwd(State(self.state.clone()), caller, ApiPath(r.name), body).await)?;
        Ok(Response::new(AuthUserChangePasswordResponse {
            header: self.header(),
        }))
    }

    async fn user_grant_role(
        &self,
        req: Request<AuthUserGrantRoleRequest>,
    ) -> Result<Response<AuthUserGrantRoleResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let path = ApiPath((r.user, r.role));
        applied(v1::user_grant_role(State(self.state.clone()), caller, path).await)?;
        Ok(Response::new(AuthUserGrantRoleResponse {
            header: self.header(),
        }))
    }

    async fn user_revoke_role(
        &self,
        req: Request<AuthUserRevokeRoleRequest>,
    ) -> Result<Response<AuthUserRevokeRoleResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let about_root = r.name == ROOT && r.role == ROOT;
        let path = ApiPath((r.name, r.role));
        let done = v1::user_revoke_role(State(self.state.clone()), caller, path).await;
        root_protected(about_root, done)?;
        Ok(Response::new(AuthUserRevokeRoleResponse {
            header: self.header(),
        }))
    }

    async fn role_add(
        &self,
        req: Request<AuthRoleAddRequest>,
    ) -> Result<Response<AuthRoleAddResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = req.into_inner().name;
        if name.is_empty() {
            return Err(empty("role"));
        }
        let body = ApiJson(RoleRequest { name });
        applied(v1::role_add(State(self.state.clone()), caller, body).await)?;
        Ok(Response::new(AuthRoleAddResponse {
            header: self.header(),
        }))
    }

    async fn role_get(
        &self,
        req: Request<AuthRoleGetRequest>,
    ) -> Result<Response<AuthRoleGetResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = req.into_inner().role;
        let is_root = name == ROOT;
        let Json(role) =
            etcd(v1::role_get(State(self.state.clone()), caller, ApiPath(name)).await)?;
        let perm = if is_root {
            vec![permission::root()]
        } else {
            role.permissions.iter().map(permission::to_etcd).collect()
        };
        Ok(Response::new(AuthRoleGetResponse {
            header: self.header(),
            perm,
        }))
    }

    async fn role_list(
        &self,
        req: Request<AuthRoleListRequest>,
    ) -> Result<Response<AuthRoleListResponse>, Status> {
        let caller = self.caller(&req)?;
        let Json(list) = etcd(v1::role_list(State(self.state.clone()), caller).await)?;
        Ok(Response::new(AuthRoleListResponse {
            header: self.header(),
            roles: list.roles,
        }))
    }

    async fn role_delete(
        &self,
        req: Request<AuthRoleDeleteRequest>,
    ) -> Result<Response<AuthRoleDeleteResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = req.into_inner().role;
        let about_root = name == ROOT;
        let done = v1::role_delete(State(self.state.clone()), caller, ApiPath(name)).await;
        root_protected(about_root, done)?;
        Ok(Response::new(AuthRoleDeleteResponse {
            header: self.header(),
        }))
    }

    async fn role_grant_permission(
        &self,
        req: Request<AuthRoleGrantPermissionRequest>,
    ) -> Result<Response<AuthRoleGrantPermissionResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let perm = r
            .perm
            .ok_or_else(|| Status::invalid_argument("etcdserver: permission not given"))?;
        let perm = permission::to_leasecore(&perm)?;
        let done = v1::role_grant(
            State(self.state.clone()),
            caller,
            ApiPath(r.name),
            ApiJson(perm),
        )
        .await;
        applied(done)?;
        Ok(Response::new(AuthRoleGrantPermissionResponse {
            header: self.header(),
        }))
    }

    async fn role_revoke_permission(
        &self,
        req: Request<AuthRoleRevokePermissionRequest>,
    ) -> Result<Response<AuthRoleRevokePermissionResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let (key, prefix) = match permission::range(&r.key, &r.range_end) {
            Ok(range) => range,
            // A range no grant can have: nothing to revoke (after the checks etcd makes
            // first: the caller, then the role).
            Err(_) => {
                let role = v1::role_get(State(self.state.clone()), caller, ApiPath(r.role));
                applied(role.await)?;
                return Err(not_granted());
            }
        };
        let query = ApiQuery(v1::RevokeQuery { key, prefix });
        let done = v1::role_revoke(State(self.state.clone()), caller, ApiPath(r.role), query).await;
        applied(done)?;
        Ok(Response::new(AuthRoleRevokePermissionResponse {
            header: self.header(),
        }))
    }
}

fn not_granted() -> Status {
    Status::failed_precondition("etcdserver: permission is not granted to the role")
}
